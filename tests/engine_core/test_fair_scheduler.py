"""The fair policy in the scheduler: the flood attack, preemption for share, the prefill
budget split, KV victims, no thrash, and tenant fields on requests."""
import math
from collections import Counter

import pytest

from engine_core.sampling_params import InvalidRequestError, SamplingParams
from tests.engine_core.factories import (make_engine, make_request, make_scheduler,
                                         run_step, run_to_completion)
from tests.engine_core.fake_executor import FakeExecutor, reference_output


def prompt(seed: int, length: int) -> list[int]:
    """Distinct prompts per seed, so no request hits another's prefix cache."""
    return [seed * 1000 + i for i in range(length)]


def tenants_running(sched) -> Counter:
    return Counter(r.tenant for r in sched.running)


@pytest.mark.parametrize("num_warmup_steps", [0, 3])
@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_flood_from_one_tenant_does_not_delay_another(policy, num_warmup_steps):
    """Tenant A floods 64 requests of 512 prompt tokens and 128 max_tokens; then B sends
    one of 16 tokens (either before the first step or once A holds every slot).

    Bound under fair: B samples its first token in the first step after it arrives.
    If a slot is free, B is under its share (0 < 8 x 1/2) and goes before A, which is
    over it; if A holds all 8 slots, A keeps its share without one (8 - 1 >= 4), so A's
    latest arrival is preempted for B. Either way B's budget cap is min(16, half of
    what decodes leave of 2048) = 16: its whole prompt computes in that step.
    Under fcfs B waits behind all 64: no slot frees before A's first 8 requests each
    decode 128 tokens, so not within 100 steps.
    """
    sched = make_scheduler(num_blocks=1200, block_size=16, max_model_len=1024,
                           max_num_batched_tokens=2048, max_num_seqs=8, policy=policy)
    executor = FakeExecutor(16)
    for i in range(64):
        sched.add_request(make_request(f"a{i}", prompt(i, 512), max_tokens=128, tenant="A"))
    for _ in range(num_warmup_steps):
        run_step(sched, executor)
    if num_warmup_steps:
        assert tenants_running(sched) == {"A": 8}
    sched.add_request(make_request("b", prompt(99, 16), max_tokens=8, tenant="B"))
    for step in range(1, 101):
        so, outs = run_step(sched, executor)
        if any(o.req_id == "b" for o in outs):
            break
    if policy == "fair":
        assert step == 1 and so.num_scheduled_tokens["b"] == 16
        assert so.preempted_req_ids == (["a7"] if num_warmup_steps else [])
    else:
        assert "b" not in so.num_scheduled_tokens
        assert sched.requests["b"].num_computed_tokens == 0


@pytest.mark.parametrize("weight_b,victims", [(1.0, ["a3", "a2"]),
                                              (3.0, ["a3", "a2", "a1"])])
def test_preemption_for_share_takes_latest_arrivals_of_the_tenant_over_share(weight_b,
                                                                             victims):
    """4 slots held by A; B (weight 1 or 3) queues 3 requests. B's share is 2 (or 3)
    slots: A gives up its latest arrivals, one per B admission, until B has its share;
    then nobody is preempted again while the shares hold."""
    sched = make_scheduler(num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
                           policy="fair")
    executor = FakeExecutor(4)
    for i in range(4):
        sched.add_request(make_request(f"a{i}", prompt(i, 8), max_tokens=30, tenant="A"))
    run_step(sched, executor)
    assert tenants_running(sched) == {"A": 4}
    for i in range(3):
        sched.add_request(make_request(f"b{i}", prompt(10 + i, 4), max_tokens=30,
                                       tenant="B", tenant_weight=weight_b))
    so, _ = run_step(sched, executor)
    assert so.preempted_req_ids == victims
    assert [n.req_id for n in so.scheduled_new_reqs] == [f"b{i}" for i in range(len(victims))]
    assert tenants_running(sched) == {"A": 4 - len(victims), "B": len(victims)}
    for _ in range(5):  # B at its share, A at its share: no more preemption
        so, _ = run_step(sched, executor)
        assert so.preempted_req_ids == []
    assert sched.num_preemptions == len(victims)


def test_fcfs_never_preempts_for_share():
    sched = make_scheduler(num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64)
    executor = FakeExecutor(4)
    for i in range(4):
        sched.add_request(make_request(f"a{i}", prompt(i, 8), max_tokens=30, tenant="A"))
    run_step(sched, executor)
    sched.add_request(make_request("b", prompt(10, 4), tenant="B"))
    so, _ = run_step(sched, executor)
    assert so.preempted_req_ids == [] and tenants_running(sched) == {"A": 4}


@pytest.mark.parametrize("policy,weight_a,expected", [
    ("fair", 1.0, {"d": 1, "a0": 32, "b": 32}),
    ("fair", 3.0, {"d": 1, "a0": 48, "b": 16}),
    ("fcfs", 1.0, {"d": 1, "a0": 64}),
])
def test_long_prefills_of_one_tenant_leave_another_its_share_of_the_budget(
        policy, weight_a, expected):
    """Budget 65. A decodes d and prefills a0 (and has a1 waiting); B sends b.
    Decodes go first (1 token), then the 64 left are split by weight over the tenants
    with prefill work: 1:1 gives 32/32, 3:1 gives 48/16. Under fcfs a0 takes all 64."""
    sched = make_scheduler(num_blocks=512, max_model_len=512, max_num_batched_tokens=65,
                           policy=policy)
    executor = FakeExecutor(4)
    sched.add_request(make_request("d", prompt(0, 4), max_tokens=20, tenant="A",
                                   tenant_weight=weight_a))
    run_step(sched, executor)  # d computes its prompt and samples: a decode from now on
    for i in (1, 2):
        sched.add_request(make_request(f"a{i - 1}", prompt(i, 400), max_tokens=2,
                                       tenant="A", tenant_weight=weight_a))
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"d": 1, "a0": 64}  # A alone: a0 uses it all
    sched.add_request(make_request("b", prompt(9, 100), max_tokens=2, tenant="B"))
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == expected


def test_kv_victim_is_the_latest_arrival_of_the_tenant_most_over_share():
    """5 usable blocks of 4; A's a0-a2 and B's b0 each filled one and need a second.
    Oldest first: a0 takes the free block; a1 finds none, and A (3 running, share 2)
    is most over its share: its latest, a2, goes; a1 gets a2's block. b0 finds none:
    A (2 running) is still more over its share than B (1), so a1 goes and b0 runs.
    (fcfs would take the latest arrivals: b0, then a2.)"""
    sched = make_scheduler(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64,
                           policy="fair")
    executor = FakeExecutor(4)
    for i in range(3):
        sched.add_request(make_request(f"a{i}", prompt(i, 4), max_tokens=8, tenant="A"))
    sched.add_request(make_request("b0", prompt(5, 4), max_tokens=8, tenant="B"))
    run_step(sched, executor)
    so, _ = run_step(sched, executor)
    assert so.preempted_req_ids == ["a2", "a1"]
    assert so.num_scheduled_tokens == {"a0": 1, "b0": 1}


def test_kv_victim_is_never_the_oldest_running_request():
    """a0 (A, the oldest) runs beside B's b0 and b1, and B weighs 10: A, with 1 running
    against a share of 3/11, is the most over its share. Preempting the oldest running
    request would give up fcfs's progress guarantee, so B's latest, b1, goes instead."""
    sched = make_scheduler(num_blocks=5, max_num_seqs=3, max_num_batched_tokens=64,
                           policy="fair")
    executor = FakeExecutor(4)
    sched.add_request(make_request("a0", prompt(0, 4), max_tokens=8, tenant="A"))
    for i in range(2):
        sched.add_request(make_request(f"b{i}", prompt(1 + i, 4), max_tokens=8,
                                       tenant="B", tenant_weight=10.0))
    run_step(sched, executor)
    so, _ = run_step(sched, executor)
    assert so.preempted_req_ids == ["b1"]
    assert so.num_scheduled_tokens == {"a0": 1, "b0": 1}


def test_a_free_slot_goes_to_a_tenant_under_its_share_first():
    """A holds 3 of 4 slots (a0 just finished) and it is still A's DRR turn, but B is
    under its share (0 < 2): the free slot goes to b0, with no preemption. Handing it
    to a4 would put A at 4 and force a preemption for b0 at once."""
    sched = make_scheduler(num_blocks=128, max_num_seqs=4, max_num_batched_tokens=64,
                           policy="fair")
    executor = FakeExecutor(4)
    for i in range(5):
        sched.add_request(make_request(f"a{i}", prompt(i, 8), max_tokens=1 if i == 0 else 30,
                                       tenant="A"))
    run_step(sched, executor)  # a0-a3 start; a0 samples its only token and finishes
    assert tenants_running(sched) == {"A": 3}
    sched.add_request(make_request("b0", prompt(9, 4), tenant="B"))
    so, _ = run_step(sched, executor)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b0"]
    assert so.preempted_req_ids == [] and [r.req_id for r in sched.waiting] == ["a4"]


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_no_livelock_when_shares_are_fractional(max_num_seqs):
    """Shares of 1/2 (or 3/2) slot: preempting A for B would put B over its share and
    A under it, and the next step would swap them back, forever, with prompts that
    need several steps. A tenant gives up a slot only if it keeps its share."""
    engine = make_engine(num_blocks=256, max_model_len=128, max_num_batched_tokens=8,
                         max_num_seqs=max_num_seqs, policy="fair")
    expected = {}
    for i in range(3):
        for tenant in "AB":
            req_id = f"{tenant}{i}"
            tokens = prompt(len(expected), 40)
            engine.add_request(req_id, tokens, SamplingParams(max_tokens=3), tenant=tenant)
            expected[req_id] = reference_output(tokens, 3)
    outs = run_to_completion(engine, max_steps=200)
    assert {k: [t for o in v for t in o.new_token_ids] for k, v in outs.items()} == expected
    assert engine.num_preemptions <= (0 if max_num_seqs == 1 else 1)


@pytest.mark.parametrize("kw,param", [
    ({"tenant": ""}, "tenant"),
    ({"tenant": "x" * 129}, "tenant"),
    ({"tenant": 7}, "tenant"),
    ({"tenant_weight": 0}, "tenant_weight"),
    ({"tenant_weight": -1.0}, "tenant_weight"),
    ({"tenant_weight": math.nan}, "tenant_weight"),
    ({"tenant_weight": math.inf}, "tenant_weight"),
    ({"tenant_weight": True}, "tenant_weight"),
    ({"tenant_weight": "2"}, "tenant_weight"),
])
def test_tenant_fields_are_validated(kw, param):
    engine = make_engine(policy="fair")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", [1, 2], **kw)
    assert err.value.param == param
    assert not engine.has_unfinished_requests()


def test_samples_share_their_parents_tenant_and_finish():
    engine = make_engine(policy="fair")
    ids = engine.add_request("p", [1, 2, 3], SamplingParams(n=3, max_tokens=4),
                             tenant="t" * 128, tenant_weight=2.5)
    engine.add_request("q", [4, 5], SamplingParams(max_tokens=4), tenant=None,
                       tenant_weight=1)
    requests = engine.scheduler.requests
    assert {(requests[i].tenant, requests[i].tenant_weight) for i in ids} == {("t" * 128, 2.5)}
    assert requests["q"].tenant is None and requests["q"].tenant_weight == 1.0
    outs = run_to_completion(engine)
    assert set(outs) == {*ids, "q"} and all(v[-1].finish_reason for v in outs.values())
    assert engine.get_stats().num_waiting_tokens == 0


def tenant_a_running(num_a: int, max_num_seqs: int = 8, policy: str = "fair"):
    """A scheduler (budget 64) whose tenant A has a0..a{num_a-1} past their prompts."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=64, policy=policy)
    executor = FakeExecutor(4)
    for i in range(num_a):
        sched.add_request(make_request(f"a{i}", prompt(i, 8), max_tokens=30, tenant="A"))
    run_step(sched, executor)
    return sched, executor


def test_a_newcomers_short_request_gets_a_step_of_its_own_then_steps_alternate():
    """A decodes a0-a3; B and C arrive (nothing running, prompts within budget / 8) and
    share a step of their own, whose outputs are their first tokens; then an ordinary
    step. D gets a step of its own; E, arriving right after it, joins an ordinary one."""
    sched, executor = tenant_a_running(4)
    sched.add_request(make_request("b", prompt(10, 6), max_tokens=4, tenant="B"))
    sched.add_request(make_request("c", prompt(11, 5), max_tokens=4, tenant="C"))
    so, outs = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"b": 6, "c": 5}  # both newcomers, A waits a step
    assert {o.req_id for o in outs} == {"b", "c"}
    so, _ = run_step(sched, executor)  # ordinary: everyone decodes
    assert so.num_scheduled_tokens == {**{f"a{i}": 1 for i in range(4)}, "b": 1, "c": 1}
    sched.add_request(make_request("d", prompt(12, 3), max_tokens=2, tenant="D"))
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"d": 3}
    sched.add_request(make_request("e", prompt(13, 3), max_tokens=2, tenant="E"))
    so, _ = run_step(sched, executor)  # never two such steps in a row: e joins the others
    assert so.num_scheduled_tokens["e"] == 3 and so.num_scheduled_tokens["a0"] == 1


@pytest.mark.parametrize("policy,prompt_len", [
    ("fair", 9),    # longer than budget / 8 = 8: an ordinary, mixed step
    ("fcfs", 4),    # only the fair policy does this
])
def test_long_newcomers_and_fcfs_take_ordinary_steps(policy, prompt_len):
    sched, executor = tenant_a_running(1, policy=policy)
    sched.add_request(make_request("b", prompt(10, prompt_len), max_tokens=4, tenant="B"))
    so, _ = run_step(sched, executor)
    assert so.num_scheduled_tokens == {"a0": 1, "b": prompt_len}


def test_a_newcomer_without_a_free_slot_is_planned_the_ordinary_way():
    """A holds every slot: B's short request gets in by preemption for share, in a mixed
    step (the flood test's case), not by a step of its own."""
    sched, executor = tenant_a_running(2, max_num_seqs=2)
    sched.add_request(make_request("b", prompt(10, 4), max_tokens=4, tenant="B"))
    so, _ = run_step(sched, executor)
    assert so.preempted_req_ids == ["a1"] and so.num_scheduled_tokens == {"a0": 1, "b": 4}
