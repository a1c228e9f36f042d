"""Multi-step decoding (engine_core/decode_steps.py): runs of decode steps when nobody
waits, their tokens equal to one step at a time, never past a request's end."""
from __future__ import annotations

import pytest

from engine_core.request import RequestStatus
from engine_core.step_cost import StepShape
from tests.engine_core.fake_executor import FakeExecutor, reference_output
from tests.engine_core.factories import (make_engine, make_request, make_scheduler,
                                         run_step, run_to_completion)


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_runs_give_the_tokens_of_single_steps():
    prompts = {"a": [5, 6, 7], "b": list(range(10, 22)), "c": [40, 41]}
    max_tokens = {"a": 13, "b": 6, "c": 9}
    engine = make_engine(num_scheduler_steps=4)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, make_request("x", 1,
                                                        max_tokens=max_tokens[req_id])
                           .sampling_params)
    by_req = run_to_completion(engine)
    for req_id, prompt in prompts.items():
        assert tokens_of(by_req[req_id]) == reference_output(prompt, max_tokens[req_id])
        assert by_req[req_id][-1].finish_reason == "length"
    runs = [so.num_decode_steps for so in engine.executor.outputs]
    assert max(runs) == 4 and runs[0] == 1  # the prefill step is never a run


def test_a_run_never_passes_max_tokens():
    sched = make_scheduler(num_scheduler_steps=8, max_model_len=20,
                           max_num_batched_tokens=32)
    sched.add_request(make_request("short", 3, max_tokens=4))
    sched.add_request(make_request("long", 14, max_tokens=6))  # up to max_model_len
    executor = FakeExecutor(4)
    run_step(sched, executor)  # both prefills: one token each
    so, outs = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"short": 3, "long": 5}
    assert so.num_decode_steps == 5
    assert [len(o.new_token_ids) for o in outs] == [3, 5]
    assert not sched.requests  # both ended
    assert sched.kv_cache_manager.usage == 0.0


def test_a_stop_token_inside_a_run_ends_the_request_there():
    prompt = [5, 6, 7]
    ref = reference_output(prompt, 30)
    stop = ref[5]
    engine = make_engine(num_scheduler_steps=8)
    engine.add_request("r", prompt, make_request("x", 1, max_tokens=30,
                                                 stop_token_ids=[stop]).sampling_params)
    outs = run_to_completion(engine)["r"]
    assert tokens_of(outs) == ref[:ref.index(stop) + 1]
    assert outs[-1].finish_reason == "stop"
    assert any(so.num_decode_steps == 8 for so in engine.executor.outputs)


def test_no_run_while_a_request_waits():
    engine = make_engine(num_scheduler_steps=4, max_num_seqs=1)
    params = make_request("x", 1, max_tokens=9).sampling_params
    engine.add_request("first", [1, 2, 3], params)
    engine.add_request("second", [4, 5], params)
    by_req = run_to_completion(engine)
    assert tokens_of(by_req["second"]) == reference_output([4, 5], 9)
    outputs = engine.executor.outputs
    first_done = next(i for i, so in enumerate(outputs) if "second" in so.num_scheduled_tokens)
    assert all(so.num_decode_steps == 1 for so in outputs[:first_done])
    assert any(so.num_decode_steps > 1 for so in outputs[first_done:])


def test_no_run_for_a_grammar_or_a_newcomer():
    sched = make_scheduler(num_scheduler_steps=4)
    sched.add_request(make_request("g", 3, max_tokens=9,
                                   structured_outputs={"regex": "[a-z]+"}))
    executor = FakeExecutor(4)
    for _ in range(3):
        so, _ = run_step(sched, executor)
        assert so.num_decode_steps == 1
    sched.add_request(make_request("plain", 3, max_tokens=9))
    so, _ = run_step(sched, executor)  # the newcomer's prefill beside g's decode
    assert so.num_decode_steps == 1 and "plain" in so.num_scheduled_tokens


def test_a_request_without_kv_room_keeps_one_step_and_nobody_is_preempted():
    # 4 usable blocks of 4 slots: after their prefills "a" and "b" hold 2 blocks each,
    # room for positions up to 7; a run of 4 from position 6 needs a third block.
    sched = make_scheduler(num_blocks=5, block_size=4, num_scheduler_steps=4,
                           enable_prefix_caching=False)
    prompts = {"a": list(range(6)), "b": list(range(50, 56))}
    for req_id, prompt in prompts.items():
        sched.add_request(make_request(req_id, prompt, max_tokens=9))
    executor = FakeExecutor(4)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for step in range(40):
        so, outs = run_step(sched, executor)
        if step == 1:
            assert so.num_scheduled_tokens == {"a": 1, "b": 1} and not so.preempted_req_ids
        for out in outs:
            tokens[out.req_id].extend(out.new_token_ids)
        if not sched.requests:
            break
    assert tokens == {r: reference_output(p, 9) for r, p in prompts.items()}


@pytest.mark.parametrize("max_step_ms, max_run_ms, most", [
    (25.0, None, 2), (None, 25.0, 2), (25.0, 100.0, 2), (100.0, 35.0, 3), (None, None, 8)])
def test_max_run_ms_and_max_step_ms_hold_a_run_to_the_steps_that_fit(max_step_ms, max_run_ms,
                                                                      most):
    sched = make_scheduler(num_scheduler_steps=8, max_step_ms=max_step_ms,
                           max_run_ms=max_run_ms, max_num_batched_tokens=64)
    clock = [0.0]
    sched.clock = lambda: clock[0]
    executor = FakeExecutor(4)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", [i * 100 + t for t in range(4)],
                                       max_tokens=60))
    runs = []
    while sched.requests:
        so = sched.schedule()
        steps = so.num_decode_steps
        shape = sched._timed_step[1]
        # 4 ms a step, 3 ms a decode row: a step of the two decodes takes 10 ms
        clock[0] += steps * (4.0 + 0.5 * shape.num_prefill_tokens
                             + 3.0 * shape.num_decode_tokens) / 1000.0
        sched.update_from_output(so, executor.execute_model(so))
        runs.append(steps)
    assert sched.step_cost.predict_ms(StepShape(0, 2, 0)) == pytest.approx(10.0, rel=0.05)
    assert max(runs) == most  # e.g. 25 ms holds two 10 ms steps, not three
    assert runs.count(most) > 5


def test_retune_acts_on_the_next_step():
    sched = make_scheduler(num_scheduler_steps=1)
    sched.add_request(make_request("r", 3, max_tokens=40))
    executor = FakeExecutor(4)
    run_step(sched, executor)
    assert run_step(sched, executor)[0].num_decode_steps == 1
    sched.config = type(sched.config)(**{**{f: getattr(sched.config, f) for f in
                                            sched.config.__dataclass_fields__},
                                         "num_scheduler_steps": 5})
    assert run_step(sched, executor)[0].num_decode_steps == 5
    assert sched.requests["r"].status is RequestStatus.RUNNING
