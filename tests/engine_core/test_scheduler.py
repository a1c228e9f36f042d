"""Scheduler: budgets, chunked prefill, preemption, admission order, rejection, aborts."""
import pytest

from engine_core.outputs import FinishReason
from engine_core.request import RequestStatus
from engine_core.sampling_params import InvalidRequestError
from tests.engine_core.factories import make_request, make_scheduler, run_step
from tests.engine_core.fake_executor import FakeExecutor, reference_output


def test_chunked_prefill_under_budget_16(executor):
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 40, max_tokens=2))
    chunks, outs = [], []
    for _ in range(4):
        so, out = run_step(sched, executor)
        chunks.append(so.num_scheduled_tokens["a"])
        outs.append(out)
    assert chunks == [16, 16, 8, 1]
    assert outs[0] == [] and outs[1] == []  # partial prefill chunks sample nothing
    assert outs[2][0].new_token_ids == reference_output(list(range(40)), 1)
    assert outs[3][0].finish_reason is FinishReason.LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.usage == 0.0


def test_decodes_share_a_step_with_prefill_chunks(executor):
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 4, max_tokens=10))
    run_step(sched, executor)
    sched.add_request(make_request("b", list(range(100, 140))))
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert so.total_num_scheduled_tokens == 16
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a"]
    [new] = so.scheduled_new_reqs
    assert (new.req_id, len(new.token_ids), new.num_computed_tokens) == ("b", 40, 0)
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert so.scheduled_new_reqs == []  # b is cached now: only new block ids travel
    assert {c.req_id for c in so.scheduled_cached_reqs} == {"a", "b"}


def test_max_num_seqs(executor):
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add_request(make_request(name, 3, max_tokens=2))
    so, _ = run_step(sched, executor)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    so, _ = run_step(sched, executor)  # a and b finish here
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    so, _ = run_step(sched, executor)
    assert set(so.num_scheduled_tokens) == {"c"}


def _two_decoders(policy, prio_a=0, prio_b=0, max_num_seqs=2):
    """a then b, 1 block each, both past their prefill; 1 block left of 3."""
    sched = make_scheduler(num_blocks=4, max_num_seqs=max_num_seqs, policy=policy)
    executor = FakeExecutor(4)
    sched.add_request(make_request("a", 4, max_tokens=8, arrival_time=0.0, priority=prio_a))
    sched.add_request(make_request("b", list(range(50, 54)), max_tokens=8, arrival_time=1.0,
                                   priority=prio_b))
    run_step(sched, executor)
    return sched, executor


def test_fcfs_preempts_latest_arrival_keeps_outputs_and_requeues_at_front():
    sched, executor = _two_decoders("fcfs")
    sched.add_request(make_request("c", list(range(70, 74)), arrival_time=2.0))
    b = sched.requests["b"]
    so, _ = run_step(sched, executor)
    # a takes the last block; b needs one too and is the latest arrival: b itself goes
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == {"b"}  # the runner drops b's state
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == reference_output(list(range(50, 54)), 1)
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    assert sched.num_preemptions == 1
    first_scheduled = []
    while "c" not in first_scheduled:
        so, _ = run_step(sched, executor)
        for new in so.scheduled_new_reqs:
            first_scheduled.append(new.req_id)
            if new.req_id == "b":
                resumed = new
    assert first_scheduled == ["b", "c"]  # the preempted request kept its place
    assert resumed.token_ids == list(range(50, 54)) + b.output_token_ids[:1]
    assert resumed.num_output_tokens == 1


def test_priority_preempts_largest_priority_value_even_if_already_scheduled():
    sched = make_scheduler(num_blocks=4, policy="priority")  # 3 usable blocks
    executor = FakeExecutor(4)
    a = make_request("a", 4, max_tokens=8, priority=1)
    sched.add_request(a)
    run_step(sched, executor)  # a: prompt computed
    sched.add_request(make_request("b", list(range(50, 54)), max_tokens=8, priority=0))
    run_step(sched, executor)  # a takes a 2nd block, b its 1st: the pool is full
    assert [r.req_id for r in sched.running] == ["a", "b"]
    so, _ = run_step(sched, executor)
    # a came first in the running order and was scheduled (no new block needed); b
    # then needed a block, and a has the larger priority value: a is unscheduled,
    # its tokens go back to the budget and its blocks to b
    assert so.num_scheduled_tokens == {"b": 1}
    assert so.total_num_scheduled_tokens == 1
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["b"]
    assert so.finished_req_ids == {"a"}
    assert a.status is RequestStatus.PREEMPTED and len(a.output_token_ids) == 2
    assert sched.kv_cache_manager.get_block_ids("a") == []
    sched.kv_cache_manager.block_pool.check_invariants()


def test_no_admission_in_a_step_with_preemption():
    sched, executor = _two_decoders("priority", prio_a=0, prio_b=1, max_num_seqs=3)
    sched.add_request(make_request("c", list(range(70, 73)), arrival_time=2.0, priority=0))
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"a": 1}  # b preempted itself; c must wait
    assert sched.requests["b"].status is RequestStatus.PREEMPTED
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"a": 1, "c": 3}  # c is ahead of b by priority


@pytest.mark.parametrize("policy,expected", [("fcfs", ["x", "y", "z"]),
                                             ("priority", ["y", "z", "x"])])
def test_admission_order(policy, expected, executor):
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for name, prio in (("x", 2), ("y", 0), ("z", 1)):
        sched.add_request(make_request(name, 3, max_tokens=1, priority=prio))
    order = []
    while sched.has_unfinished_requests():
        so, _ = run_step(sched, executor)
        order += [n.req_id for n in so.scheduled_new_reqs]
    assert order == expected


def test_chunked_prefill_off_waits_for_a_whole_fit(executor):
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 4, max_tokens=3))
    run_step(sched, executor)
    sched.add_request(make_request("b", list(range(100, 116))))
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"a": 1}  # 16 tokens do not fit next to a decode
    while "b" not in so.num_scheduled_tokens:
        so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"b": 16}


def test_chunked_prefill_off_rejects_prompts_over_the_budget():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(make_request("a", 9, max_tokens=1))
    assert err.value.param == "prompt"
    sched.add_request(make_request("b", 8, max_tokens=1))


@pytest.mark.parametrize("num_blocks,prompt,max_tokens,param", [
    (9, 30, 3, "max_tokens"),  # 33 > max_model_len 32
    (9, 32, 1, "prompt"),  # no room for one output
    (6, 10, 11, "max_tokens"),  # 21 tokens > 5 usable blocks of 4
    (6, 20, 1, "prompt"),  # the prompt alone overflows the pool
])
def test_never_fitting_requests_are_rejected(num_blocks, prompt, max_tokens, param, executor):
    sched = make_scheduler(num_blocks=num_blocks, max_model_len=32)
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(make_request("a", prompt, max_tokens=max_tokens))
    assert err.value.param == param
    assert not sched.has_unfinished_requests()
    assert run_step(sched, executor)[0].is_empty


def test_request_filling_the_whole_pool_completes(executor):
    sched = make_scheduler(num_blocks=6, max_model_len=32)
    sched.add_request(make_request("a", 10, max_tokens=10))  # 20 tokens = 5 blocks
    sched.add_request(make_request("b", list(range(40, 50)), max_tokens=10))
    outs = {}
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        for out in run_step(sched, executor)[1]:
            outs.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert outs["a"] == reference_output(list(range(10)), 10)
    assert outs["b"] == reference_output(list(range(40, 50)), 10)
    assert sched.num_preemptions > 0


def test_abort_running_frees_blocks_and_reports_once(executor):
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 10, max_tokens=5))
    sched.add_request(make_request("w", 10, max_tokens=5))
    run_step(sched, executor)
    assert sched.kv_cache_manager.usage > 0
    sched.finish_requests(["a", "w", "unknown"])
    assert sched.kv_cache_manager.usage == 0.0 and not sched.has_unfinished_requests()
    assert sched.has_pending_outputs()
    so, outs = run_step(sched, executor)
    assert so.finished_req_ids == {"a"}  # w never reached the runner
    assert {(o.req_id, o.finish_reason, tuple(o.new_token_ids)) for o in outs} == {
        ("a", FinishReason.ABORT, ()), ("w", FinishReason.ABORT, ())}
    assert run_step(sched, executor)[1] == []
    sched.kv_cache_manager.block_pool.check_invariants()


def test_finish_requests_rejects_unfinished_status():
    with pytest.raises(ValueError):
        make_scheduler().finish_requests("a", RequestStatus.RUNNING)


def test_scheduler_fills_missing_max_tokens(executor):
    sched = make_scheduler(max_model_len=12)
    req = make_request("a", 5, max_tokens=None)
    sched.add_request(req)
    assert req.max_tokens == 7
