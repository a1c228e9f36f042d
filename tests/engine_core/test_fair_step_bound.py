"""scheduler.fair_step_factor: while tenants share the engine under ``fair``, steps are
held to a multiple of a short prompt's step alone, decodes taken round robin with
tenants interleaved (engine_core/fair_step.py, tenant_activity.py, step_cost.py)."""
import pytest

from engine_core.step_cost import SHORT_PROMPT_TOKENS, StepCost, StepShape
from engine_core.tenant_activity import (FOLLOW_UP_FACTOR, FOLLOW_UP_S, WINDOW_S,
                                         TenantActivity)
from tests.engine_core.factories import make_request, make_scheduler
from tests.engine_core.fake_executor import FakeExecutor
from tests.engine_core.test_step_cost import linear_ms, random_shape, run_timed_step


def test_a_tenant_counts_for_the_window_after_it_was_last_seen():
    activity = TenantActivity()
    activity.observe(["A", "B"], now=100.0)
    activity.observe(["A"], now=105.0)
    assert activity.num_active(105.0) == 2
    assert activity.num_active(100.0 + WINDOW_S) == 2
    assert activity.num_active(100.0 + WINDOW_S + 0.5) == 1  # B's window ran out
    activity.observe([None], now=120.0)  # the anonymous tenant counts like any other
    assert activity.num_active(120.0) == 1  # A's ran out too


def test_a_follow_up_is_expected_briefly_after_a_tenant_went_idle():
    activity = TenantActivity()
    activity.observe(["A", "B"], now=1.0)
    assert not activity.expects_follow_up(1.0)
    activity.went_idle("B", now=2.0)
    assert activity.expects_follow_up(2.0 + FOLLOW_UP_S / 2)
    assert not activity.expects_follow_up(2.0 + FOLLOW_UP_S * 1.5)
    activity.went_idle("B", now=3.0)
    activity.observe(["A", "B"], now=3.01)  # B's next request came
    assert not activity.expects_follow_up(3.02)
    assert activity.num_active(3.02) == 2


def test_short_step_ms_follows_only_a_short_prompt_alone():
    import random
    cost = StepCost()
    rng = random.Random(3)
    for _ in range(20):
        shape = random_shape(rng)
        cost.observe(shape, linear_ms(shape))
    assert cost.short_step_ms is None
    cost.observe(StepShape(9, 0, 0, True), 20.0)
    assert cost.short_step_ms == 20.0
    cost.observe(StepShape(30, 0, 0, True), 40.0)  # a moving average
    assert 20.0 < cost.short_step_ms < 40.0


def test_only_a_whole_short_prompt_alone_counts_as_a_short_step():
    """The scheduler marks a step of one newcomer's whole short prompt, not a chunk of
    a long prompt running alone, nor a short prompt beside a decode."""
    sched = make_scheduler(num_blocks=400, block_size=16, max_model_len=2048,
                           max_num_batched_tokens=SHORT_PROMPT_TOKENS, max_num_seqs=8,
                           policy="fair")
    executor = FakeExecutor(16)
    sched.add_request(make_request("long", SHORT_PROMPT_TOKENS + 40, max_tokens=3))
    marks = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        marks.append(sched._timed_step[1].is_short_prompt_alone)
        sched.update_from_output(so, executor.execute_model(so))
    assert marks == [False] * len(marks)  # 256 + 40 in two chunks, then decodes
    sched.add_request(make_request("short", [7000 + t for t in range(9)], max_tokens=2))
    so = sched.schedule()
    assert sched._timed_step[1].is_short_prompt_alone


def test_decodes_within_prices_each_decode_at_the_fit():
    import random
    cost = StepCost()
    assert cost.decodes_within(100.0, [10] * 8, 5.0) is None  # nothing learned yet
    rng = random.Random(0)
    for _ in range(60):
        shape = random_shape(rng)
        cost.observe(shape, linear_ms(shape))
    # 1.2 ms a decode + 2 us a context token: (50 - 10) / (1.2 + 0.1) = 30.7
    assert cost.decodes_within(50.0, [50_000 // 1000] * 64, 10.0) == pytest.approx(30, abs=2)
    assert cost.decodes_within(500.0, [50] * 64, 10.0) == 64
    assert cost.decodes_within(5.0, [50] * 64, 10.0) == 1  # always one


def flood_and_newcomer(factor: float):
    """Tenant A's 48 requests decoding (a step of them takes about 120 ms on the test
    machine), then B's 9-token prompt arrives; returns the scheduler mid-way."""
    sched = make_scheduler(num_blocks=4000, block_size=16, max_model_len=2048,
                           max_num_batched_tokens=2048, max_num_seqs=64, policy="fair",
                           fair_step_factor=factor)
    clock = [0.0]
    sched.clock = lambda: clock[0]
    executor = FakeExecutor(16)
    for i in range(48):
        sched.add_request(make_request(f"a{i}", [i * 5000 + t for t in range(400)],
                                       max_tokens=200, tenant="A"))
    while any(not r.is_decoding for r in sched.running) or sched.waiting:
        run_timed_step(sched, executor, clock)
    for _ in range(3):
        _, shape, _ = run_timed_step(sched, executor, clock)
    assert shape.num_decode_tokens == 48 and linear_ms(shape) > 100
    sched.add_request(make_request("b0", [900_000 + t for t in range(9)], max_tokens=12,
                                   tenant="B"))
    return sched, executor, clock


def test_steps_are_held_while_tenants_share_and_free_after():
    sched, executor, clock = flood_and_newcomer(4.0)
    so, shape, _ = run_timed_step(sched, executor, clock)
    assert list(so.num_scheduled_tokens) == ["b0"]  # its first token: a step alone
    short_ms = linear_ms(shape)
    assert sched.step_cost.short_step_ms == pytest.approx(short_ms)
    bound = 4.0 * short_ms  # about 49 ms against the flood's 120
    skipped: dict[str, int] = {}
    while "b0" in sched.requests:
        running = [r.req_id for r in sched.running]
        so, shape, _ = run_timed_step(sched, executor, clock)
        assert linear_ms(shape) <= bound * 1.05
        assert "b0" in so.num_scheduled_tokens  # the light tenant decodes every step
        for req_id in running:
            skipped[req_id] = 0 if req_id in so.num_scheduled_tokens else \
                skipped.get(req_id, 0) + 1
        assert max(skipped.values()) <= 2  # round robin: 48 decodes over ~3 steps
    # B is gone; within its window the steps stay short, past it A runs whole steps
    _, shape, _ = run_timed_step(sched, executor, clock)
    assert shape.num_decode_tokens < 48
    clock[0] += WINDOW_S + 1.0
    _, shape, _ = run_timed_step(sched, executor, clock)
    assert shape.num_decode_tokens == 48


def test_factor_zero_leaves_steps_whole():
    sched, executor, clock = flood_and_newcomer(0.0)
    so, _, _ = run_timed_step(sched, executor, clock)
    assert list(so.num_scheduled_tokens) == ["b0"]
    so, shape, _ = run_timed_step(sched, executor, clock)
    assert shape.num_decode_tokens == 49  # A's 48 and B's first decode


def test_held_steps_still_finish_every_request():
    """Under the bound every request of both tenants finishes with all its tokens."""
    sched, executor, clock = flood_and_newcomer(2.0)
    requests = dict(sched.requests)
    steps = 0
    while sched.has_unfinished_requests() and steps < 5000:
        run_timed_step(sched, executor, clock)
        steps += 1
    assert not sched.has_unfinished_requests()
    assert requests["b0"].num_output_tokens == 12
    assert {requests[f"a{i}"].num_output_tokens for i in range(48)} == {200}


def test_fair_step_factor_is_live():
    """Retuned to 0 mid-flood (config/live_config.py lists it), whole steps come back
    at once; retuned back, the measured short step bounds them again."""
    import dataclasses
    sched, executor, clock = flood_and_newcomer(4.0)
    run_timed_step(sched, executor, clock)  # B's first token, alone
    _, shape, _ = run_timed_step(sched, executor, clock)
    assert shape.num_decode_tokens < 49
    sched.config = dataclasses.replace(sched.config, fair_step_factor=0.0)
    _, shape, _ = run_timed_step(sched, executor, clock)
    assert shape.num_decode_tokens == 49
    sched.config = dataclasses.replace(sched.config, fair_step_factor=4.0)
    _, shape, _ = run_timed_step(sched, executor, clock)
    assert shape.num_decode_tokens < 49


def test_steps_right_after_a_tenant_went_idle_are_one_short_step():
    """B's request ends: for FOLLOW_UP_S the flood's steps are held to about one short
    step (B's next request would wait for one of those), then to the factor again;
    B's next request ends the window at once."""
    sched, executor, clock = flood_and_newcomer(4.0)
    _, shape, _ = run_timed_step(sched, executor, clock)
    short_ms = linear_ms(shape)
    held = []
    while "b0" in sched.requests:
        held.append(linear_ms(run_timed_step(sched, executor, clock)[1]))
    assert max(held) > 2 * short_ms  # held to 4 short steps while B ran
    _, shape, _ = run_timed_step(sched, executor, clock)
    assert linear_ms(shape) <= FOLLOW_UP_FACTOR * short_ms * 1.05
    clock[0] += FOLLOW_UP_S
    _, shape, _ = run_timed_step(sched, executor, clock)
    assert 2 * short_ms < linear_ms(shape) <= 4 * short_ms * 1.05
    sched.add_request(make_request("b1", [800_000 + t for t in range(9)], max_tokens=2,
                                   tenant="B"))
    so, _, _ = run_timed_step(sched, executor, clock)
    assert list(so.num_scheduled_tokens) == ["b1"]
