"""EngineCore: validation, n > 1 expansion, stop rules, aborts, stats, consistency."""
import pytest

from engine_core.outputs import FinishReason
from engine_core.sampling_params import InvalidRequestError, SamplingParams
from tests.engine_core.factories import make_engine, run_to_completion
from tests.engine_core.fake_executor import reference_output


def tokens_of(outs):
    return [t for o in outs for t in o.new_token_ids]


def count_up(tokens):
    """Next token = current length: a prompt of 3 yields 3, 4, 5, ..."""
    return len(tokens)


@pytest.mark.parametrize("prompt,kw,param", [
    ([], {}, "prompt"),
    ([1, 100], {}, "prompt"),  # vocab_size is 100
    ([1, -1], {}, "prompt"),
    ([1, True], {}, "prompt"),
    (list(range(32)), {}, "prompt"),  # max_model_len 32
    (list(range(30)), {"max_tokens": 3}, "max_tokens"),
])
def test_add_request_validation(prompt, kw, param):
    engine = make_engine(max_model_len=32, vocab_size=100)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("a", prompt, SamplingParams(**kw))
    assert err.value.param == param
    assert not engine.has_unfinished_requests()


def test_duplicate_ids_are_rejected():
    engine = make_engine()
    engine.add_request("a", [1, 2])
    engine.add_request("p", [1, 2], SamplingParams(n=2))
    for req_id, n in (("a", 1), ("p", 1), ("0_p", 1), ("a", 2)):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(req_id, [1], SamplingParams(n=n))
        assert err.value.param == "req_id"
    run_to_completion(engine)
    engine.add_request("a", [1, 2])  # a finished id may be reused


def test_max_tokens_none_fills_the_model_length():
    engine = make_engine(max_model_len=12)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=None))
    assert engine.scheduler.requests["a"].max_tokens == 9
    outs = run_to_completion(engine)["a"]
    assert len(tokens_of(outs)) == 9 and outs[-1].finish_reason is FinishReason.LENGTH


def test_n_samples_get_ids_indices_and_distinct_seeds():
    engine = make_engine()
    ids = engine.add_request("p", [1, 2, 3], SamplingParams(n=3, seed=7, max_tokens=2))
    seeds = [engine.scheduler.requests[i].sampling_params.seed for i in ids]
    assert ids == ["0_p", "1_p", "2_p"] and seeds == [7, 8, 9]
    assert all(engine.scheduler.requests[i].sampling_params.n == 1 for i in ids)
    outs = run_to_completion(engine)
    assert {(o.parent_req_id, o.index) for i in ids for o in outs[i]} == {
        ("p", 0), ("p", 1), ("p", 2)}


def test_eos_stops_but_not_before_min_tokens():
    engine = make_engine(eos_token_ids=(5,), token_fn=count_up)
    engine.add_request("eos", [0, 1, 2], SamplingParams(max_tokens=8))
    engine.add_request("min", [0, 1, 2], SamplingParams(max_tokens=5, min_tokens=4))
    engine.add_request("ign", [0, 1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("stop", [0, 1, 2], SamplingParams(max_tokens=8, stop_token_ids=[4]))
    outs = run_to_completion(engine)
    assert tokens_of(outs["eos"]) == [3, 4, 5]
    assert (outs["eos"][-1].finish_reason, outs["eos"][-1].stop_reason) == (
        FinishReason.STOP, None)
    assert tokens_of(outs["min"]) == [3, 4, 5, 6, 7]
    assert outs["min"][-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(outs["ign"]) == [3, 4, 5, 6, 7]
    assert tokens_of(outs["stop"]) == [3, 4]
    assert (outs["stop"][-1].finish_reason, outs["stop"][-1].stop_reason) == (
        FinishReason.STOP, 4)


def test_max_model_len_ends_a_request():
    engine = make_engine(max_model_len=6, token_fn=count_up)
    engine.add_request("a", [0, 1, 2], SamplingParams(max_tokens=3))
    outs = run_to_completion(engine)["a"]
    assert tokens_of(outs) == [3, 4, 5] and outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_abort_is_reported_on_the_next_step_even_when_idle():
    engine = make_engine()
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=20))
    engine.step()
    engine.abort_request("a")
    assert engine.has_unfinished_requests()  # the final output is still owed
    calls = engine.executor.num_steps
    [out] = engine.step()
    assert (out.req_id, out.finish_reason, out.new_token_ids) == ("a", FinishReason.ABORT, [])
    assert engine.executor.num_steps == calls + 1  # it ran to drop the runner's state
    assert engine.executor.outputs[-1].finished_req_ids == {"a"}
    assert not engine.has_unfinished_requests()
    assert engine.step() == [] and engine.executor.num_steps == calls + 1


def test_prefix_cache_stats_and_cached_tokens_reported():
    engine = make_engine()
    engine.add_request("a", list(range(12)), SamplingParams(max_tokens=2))
    first = run_to_completion(engine)["a"]
    engine.add_request("b", list(range(12)), SamplingParams(max_tokens=2))
    second = run_to_completion(engine)["b"]
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 8 and second[1].num_cached_tokens == 0
    assert engine.executor.outputs[-2].num_cached_tokens == {"b": 8}
    stats = engine.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24, 8)
    assert engine.reset_prefix_cache() is True
    engine.add_request("c", list(range(12)), SamplingParams(max_tokens=2))
    assert run_to_completion(engine)["c"][0].num_cached_tokens == 0


def test_reset_prefix_cache_refused_while_busy():
    engine = make_engine()
    engine.add_request("a", list(range(12)), SamplingParams(max_tokens=5))
    engine.step()
    assert engine.reset_prefix_cache() is False
    assert engine.kv_cache_usage > 0 and engine.get_stats().num_running == 1


PROMPTS = [list(range(i, i + 5 + 3 * i)) for i in range(6)] + [list(range(9))] * 2


@pytest.mark.parametrize("kw", [
    dict(),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=32),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=3),
    dict(num_blocks=10),  # forced preemption
    dict(num_blocks=10, policy="priority", max_num_seqs=2),
])
def test_outputs_do_not_depend_on_scheduling(kw):
    engine = make_engine(**kw)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, priority=i % 3))
    outs = run_to_completion(engine)
    for i, prompt in enumerate(PROMPTS):
        assert tokens_of(outs[f"r{i}"]) == reference_output(prompt, 6)
    if kw.get("num_blocks") == 10:
        assert engine.num_preemptions > 0
    assert engine.kv_cache_usage == 0.0


def test_validate_request_checks_without_queuing():
    engine = make_engine(max_model_len=32, vocab_size=100)
    params = engine.validate_request([1, 2, 3], SamplingParams(max_tokens=None))
    assert params.max_tokens == 29 and not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError) as err:
        engine.validate_request([1, 2, 3], SamplingParams(max_tokens=30))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        engine.validate_request([1], lora_id=-1)
    assert err.value.param == "lora_id"
    assert engine.add_request("g", iter([1, 2, 3])) == ["g"]  # any iterable prompt
    assert engine.scheduler.requests["g"].prompt_token_ids == [1, 2, 3]
