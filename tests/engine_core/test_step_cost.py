"""scheduler.max_step_ms: the learned step time (engine_core/step_cost.py) and the
budget the scheduler derives from it, with a clock driven by a known cost model."""
import random

import pytest

from engine_core.step_cost import MIN_STEPS, StepCost, StepShape
from tests.engine_core.factories import make_request, make_scheduler
from tests.engine_core.fake_executor import FakeExecutor


def linear_ms(shape: StepShape) -> float:
    """A machine: 4 ms a step, 0.9 ms a prefill token, 1.2 ms a decode, 2 us a context
    token the decodes attend to."""
    return (4.0 + 0.9 * shape.num_prefill_tokens + 1.2 * shape.num_decode_tokens
            + 0.002 * shape.decode_context)


def random_shape(rng: random.Random) -> StepShape:
    return StepShape(rng.randrange(0, 2049), rng.randrange(0, 65), rng.randrange(0, 40000))


def test_fit_recovers_the_machine_and_sizes_prefill():
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(MIN_STEPS - 1):
        cost.observe(random_shape(rng), linear_ms(random_shape(rng)))
    assert cost.predict_ms(StepShape(1, 1, 1)) is None  # too few steps yet
    cost = StepCost()
    for _ in range(60):
        shape = random_shape(rng)
        cost.observe(shape, linear_ms(shape))
    for _ in range(20):
        shape = random_shape(rng)
        assert cost.predict_ms(shape) == pytest.approx(linear_ms(shape), rel=0.02, abs=1.0)
    # 150 ms beside 32 decodes at 20,000 context tokens: (150 - 4 - 38.4 - 40) / 0.9
    assert cost.prefill_tokens_within(150.0, 32, 20000, 16) == pytest.approx(75, abs=2)
    # decodes alone over the target: prefill still gets the floor
    assert cost.prefill_tokens_within(50.0, 64, 40000, 16) == 16


def test_no_bound_until_prefill_was_seen():
    cost = StepCost()
    for d in range(1, 20):  # decode-only steps say nothing about a prefill token
        cost.observe(StepShape(0, d, 100 * d), linear_ms(StepShape(0, d, 100 * d)))
    assert cost.prefill_tokens_within(100.0, 8, 800, 16) is None


def test_fit_follows_a_machine_that_slows_down():
    rng = random.Random(1)
    cost = StepCost()
    for _ in range(40):
        shape = random_shape(rng)
        cost.observe(shape, linear_ms(shape))
    for _ in range(150):  # now twice as slow (a neighbour took the cores)
        shape = random_shape(rng)
        cost.observe(shape, 2 * linear_ms(shape))
    shape = StepShape(512, 16, 8000)
    assert cost.predict_ms(shape) == pytest.approx(2 * linear_ms(shape), rel=0.03)


def run_timed_step(sched, executor, clock):
    """One step whose wall time, on the scheduler's clock, is linear_ms of its shape."""
    so = sched.schedule()
    shape = sched._timed_step[1]
    clock[0] += linear_ms(shape) / 1000.0
    return so, shape, sched.update_from_output(so, executor.execute_model(so))


def flooded_scheduler(policy, max_step_ms, max_num_seqs, num_requests, prompt_len,
                      max_tokens):
    """A scheduler on a clock the test drives, with tenant A's flood queued."""
    sched = make_scheduler(num_blocks=4000, block_size=16, max_model_len=2048,
                           max_num_batched_tokens=2048, max_num_seqs=max_num_seqs,
                           policy=policy, max_step_ms=max_step_ms)
    clock = [0.0]
    sched.clock = lambda: clock[0]
    for i in range(num_requests):
        sched.add_request(make_request(f"a{i}", [i * 5000 + t for t in range(prompt_len)],
                                       max_tokens=max_tokens, tenant="A"))
    return sched, FakeExecutor(16), clock


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_steps_stay_within_max_step_ms_once_learned(policy):
    """A tenant floods 24 prompts of 1,000 tokens; uncapped, steps carry 2,048 prefill
    tokens (1.8 s on this machine). With max_step_ms = 120 every step after the first
    few stays within 120 ms plus one prediction error, every request still finishes,
    and decodes are never cut under fcfs; under fair (round robin) none waits more
    than a step while the fit is being learned."""
    sched, executor, clock = flooded_scheduler(policy, 120.0, 32, num_requests=24,
                                               prompt_len=1000, max_tokens=24)
    times, steps = [], 0
    skipped: dict[str, int] = {}  # running decode -> steps it was left out in a row
    while sched.has_unfinished_requests() and steps < 2000:
        running_decodes = [r.req_id for r in sched.running
                           if r.num_tokens - r.num_computed_tokens <= 1]
        so, shape, _ = run_timed_step(sched, executor, clock)
        for req_id in running_decodes:
            skipped[req_id] = 0 if req_id in so.num_scheduled_tokens else \
                skipped.get(req_id, 0) + 1
        assert max(skipped.values(), default=0) <= (0 if policy == "fcfs" else 1)
        times.append(linear_ms(shape))
        steps += 1
    assert not sched.has_unfinished_requests()
    assert max(times[:MIN_STEPS]) > 1800  # the first steps run uncapped
    # afterwards: within the target but for the floor of one block beside decodes
    floor_ms = [t for t in times[MIN_STEPS + 4:] if t > 125.0]
    assert not floor_ms, f"steps over 125 ms after learning: {floor_ms[:5]}"
    assert sum(times[MIN_STEPS + 4:]) / len(times[MIN_STEPS + 4:]) > 60  # not starved


def test_fair_newcomer_waits_one_short_step():
    """Under fair with max_step_ms, B's 200-token prompt arriving mid-flood computes in
    the next step, a step of its own (not lowered by the bound), and the step it waited
    for was within the target."""
    sched, executor, clock = flooded_scheduler("fair", 100.0, 64, num_requests=64,
                                               prompt_len=512, max_tokens=64)
    for _ in range(30):
        _, shape, _ = run_timed_step(sched, executor, clock)
    assert linear_ms(shape) <= 105.0
    sched.add_request(make_request("b", [999_000 + t for t in range(200)], max_tokens=4,
                                   tenant="B"))
    so, shape, outs = run_timed_step(sched, executor, clock)
    assert list(so.num_scheduled_tokens) == ["b"] and so.num_scheduled_tokens["b"] == 200
    assert [o.req_id for o in outs] == ["b"]


def test_max_step_ms_is_live():
    """Retuned under a running flood, the bound applies from the next step (the fit was
    learned all along), and turning it off restores the token budget."""
    import dataclasses

    from engine_core.live_limits import apply_live_limits
    from tests.engine_core.factories import make_engine
    engine = make_engine(num_blocks=2000, block_size=16, max_model_len=2048,
                         max_num_batched_tokens=512, max_num_seqs=16)
    sched = engine.scheduler
    clock = [0.0]
    sched.clock = lambda: clock[0]
    for i in range(16):
        sched.add_request(make_request(f"a{i}", [i * 5000 + t for t in range(1500)],
                                       max_tokens=8))
    for _ in range(6):
        run_timed_step(sched, engine.executor, clock)
    _, shape, _ = run_timed_step(sched, engine.executor, clock)
    assert linear_ms(shape) > 400  # full 512-token steps
    apply_live_limits(engine, dataclasses.replace(sched.config, max_step_ms=60.0))
    shapes = [run_timed_step(sched, engine.executor, clock)[1] for _ in range(8)]
    assert all(linear_ms(shape) <= 63.0 for shape in shapes)
    # alike steps so far left the fit ambiguous; the short steps resolve it
    assert shapes[-1].num_prefill_tokens > 40
    apply_live_limits(engine, dataclasses.replace(sched.config, max_step_ms=None))
    _, shape, _ = run_timed_step(sched, engine.executor, clock)
    assert shape.num_prefill_tokens + shape.num_decode_tokens == 512
