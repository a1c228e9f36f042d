"""n > 1: samples fork from sample 0 once its prompt is computed (copy-on-write)."""
from engine_core.outputs import FinishReason
from engine_core.request import RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler_output import BlockCopy
from tests.engine_core.factories import make_engine, run_to_completion
from tests.engine_core.fake_executor import reference_output


def ref_counts(kv, block_ids):
    return [kv.block_pool.blocks[i].ref_cnt for i in block_ids]


def test_n3_shares_prompt_blocks_and_copies_the_partial_one():
    engine = make_engine(num_blocks=20)
    kv = engine.scheduler.kv_cache_manager
    ids = engine.add_request("p", list(range(10)), SamplingParams(n=3, max_tokens=3))
    assert ids == ["0_p", "1_p", "2_p"]
    assert (engine.scheduler.num_running, engine.scheduler.num_waiting) == (0, 3)
    outs = engine.step()
    so = engine.executor.outputs[-1]
    assert so.num_scheduled_tokens == {"0_p": 10}  # the others wait for the fork
    src = kv.get_block_ids("0_p")
    c1, c2 = kv.get_block_ids("1_p"), kv.get_block_ids("2_p")
    assert c1[:2] == c2[:2] == src[:2]
    assert ref_counts(kv, src) == [3, 3, 1]
    assert len({c1[2], c2[2], src[2]}) == 3
    assert kv.usage == 5 / 19  # 3 + one private copy each, instead of 9
    assert engine.scheduler.requests["1_p"].num_computed_tokens == 9
    outs += engine.step()
    so = engine.executor.outputs[-1]
    assert so.blocks_to_copy == [BlockCopy(src[2], c1[2]), BlockCopy(src[2], c2[2])]
    assert so.num_scheduled_tokens == {"0_p": 1, "1_p": 1, "2_p": 1}
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["1_p"].block_ids == c1 and new["1_p"].num_computed_tokens == 9
    assert so.num_cached_tokens == {"1_p": 9, "2_p": 9}
    for rid, later in run_to_completion(engine).items():
        outs += later
    want = reference_output(list(range(10)), 3)
    for i in range(3):
        mine = [o for o in outs if o.req_id == f"{i}_p"]
        assert [t for o in mine for t in o.new_token_ids] == want
        assert all(o.parent_req_id == "p" and o.index == i for o in mine)
        assert mine[-1].finish_reason is FinishReason.LENGTH
    assert kv.usage == 0.0
    kv.block_pool.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    engine = make_engine(num_blocks=20)
    engine.add_request("p", list(range(9)), SamplingParams(n=2, max_tokens=2))
    engine.step()
    kv = engine.scheduler.kv_cache_manager
    assert kv.get_block_ids("1_p") == kv.get_block_ids("0_p")[:2]
    engine.step()
    assert engine.executor.outputs[-1].blocks_to_copy == []
    run_to_completion(engine)


def test_samples_waiting_for_fork_do_not_count_against_max_num_seqs():
    engine = make_engine(max_num_seqs=1)
    engine.add_request("p", list(range(6)), SamplingParams(n=3, max_tokens=2))
    engine.add_request("q", list(range(30, 36)), SamplingParams(max_tokens=2))
    engine.step()
    assert engine.executor.outputs[-1].num_scheduled_tokens == {"0_p": 6}
    outs = run_to_completion(engine)
    assert set(outs) == {"0_p", "1_p", "2_p", "q"}


def test_source_aborted_before_its_prompt_completes_hands_over():
    engine = make_engine(max_num_batched_tokens=4)
    engine.add_request("p", list(range(10)), SamplingParams(n=3, max_tokens=2))
    engine.step()  # 0_p computed 4 of 10 prompt tokens
    engine.abort_request("0_p")
    sched = engine.scheduler
    assert sched.requests["1_p"].status is RequestStatus.WAITING
    assert sched.requests["2_p"].status is RequestStatus.WAITING_FOR_FORK
    outs = run_to_completion(engine)
    assert [o.finish_reason for o in outs["0_p"]] == [FinishReason.ABORT]
    forked = [n for so in engine.executor.outputs for n in so.scheduled_new_reqs
              if n.req_id == "2_p"]
    assert forked[0].num_computed_tokens == 9  # 2_p forked from 1_p
    want = reference_output(list(range(10)), 2)
    for rid in ("1_p", "2_p"):
        assert [t for o in outs[rid] for t in o.new_token_ids] == want


def test_source_preempted_before_its_prompt_completes_keeps_its_samples():
    engine = make_engine(num_blocks=4, max_num_batched_tokens=4)
    engine.add_request("r", list(range(50, 53)), SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request("p", list(range(8)), SamplingParams(n=3, max_tokens=1))
    source = engine.scheduler.requests["0_p"]
    engine.step()
    engine.step()  # r needs a block; 0_p (latest arrival) is preempted mid-prompt
    assert source.status is RequestStatus.PREEMPTED and source.num_output_tokens == 0
    assert engine.scheduler.forks.num_waiters == 2
    outs = run_to_completion(engine)
    want = reference_output(list(range(8)), 1)
    for rid in ("0_p", "1_p", "2_p"):
        assert [t for o in outs[rid] for t in o.new_token_ids] == want
    assert outs["r"][-1].finish_reason is FinishReason.LENGTH


def test_parked_samples_give_their_blocks_back_under_pressure():
    # 4 usable blocks, each sample needs all 4 alone, caching off: forked samples that
    # hold blocks while waiting would deadlock the pool if they were never reclaimed.
    engine = make_engine(num_blocks=5, enable_prefix_caching=False)
    engine.add_request("p", list(range(6)), SamplingParams(n=4, max_tokens=10))
    outs = run_to_completion(engine, max_steps=500)
    want = reference_output(list(range(6)), 10)
    for i in range(4):
        assert [t for o in outs[f"{i}_p"] for t in o.new_token_ids] == want
    restarted = [n for so in engine.executor.outputs for n in so.scheduled_new_reqs
                 if n.req_id != "0_p" and n.num_computed_tokens == 0]
    assert restarted  # some sample lost its forked blocks and recomputed
    assert engine.kv_cache_usage == 0.0


def test_abort_parent_id_aborts_every_sample():
    engine = make_engine()
    engine.add_request("p", list(range(10)), SamplingParams(n=3, max_tokens=5))
    engine.step()
    engine.abort_request("p")
    assert not engine.scheduler.has_unfinished_requests()
    outs = engine.step()
    assert sorted((o.req_id, o.finish_reason) for o in outs) == [
        (f"{i}_p", FinishReason.ABORT) for i in range(3)]
    assert engine.kv_cache_usage == 0.0 and not engine.has_unfinished_requests()


def test_samples_fork_even_when_the_source_finishes_in_the_same_step():
    engine = make_engine()
    engine.add_request("p", list(range(10)), SamplingParams(n=3, max_tokens=1))
    [out] = engine.step()  # 0_p computes its prompt, samples once and is done
    assert out.req_id == "0_p" and out.finish_reason is FinishReason.LENGTH
    assert "0_p" not in engine.scheduler.requests
    engine.step()
    so = engine.executor.outputs[-1]
    assert so.finished_req_ids == {"0_p"}
    assert {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs} == {
        "1_p": 9, "2_p": 9}
    assert len(so.blocks_to_copy) == 2  # copied from 0_p's freed block before reuse
    assert not engine.has_unfinished_requests() and engine.kv_cache_usage == 0.0
