"""Live retune of a running engine (engine_core/live_limits.py): the next steps plan
under the new limits and no request is lost."""
import dataclasses

import pytest

from config.speculative import SpeculativeConfig
from tests.engine_core.factories import make_engine, make_request, run_to_completion


def add(engine, n, prompt_len=6, max_tokens=8):
    for i in range(n):
        engine.add_request(f"r{i}", list(range(1, prompt_len + 1)),
                           make_request("x", 1, max_tokens=max_tokens).sampling_params)


def test_lowering_max_num_seqs_caps_the_next_steps_without_dropping_requests():
    from engine_core.live_limits import apply_live_limits
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=64)
    add(engine, 6)
    engine.step()
    assert engine.get_stats().num_running == 6
    cfg = engine.scheduler.config
    apply_live_limits(engine, dataclasses.replace(cfg, max_num_seqs=2))
    add_more = [f"s{i}" for i in range(4)]
    for req_id in add_more:
        engine.add_request(req_id, [1, 2, 3], make_request("y", 1, max_tokens=4).sampling_params)
    peak_after = 0
    finished = set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        finished |= {o.req_id for o in outputs if o.finished}
        stats = engine.get_stats()
        # running requests finish; none is admitted while the batch is at or over 2
        if stats.num_running <= 2:
            peak_after = max(peak_after, stats.num_running)
    assert finished == {f"r{i}" for i in range(6)} | set(add_more)
    assert peak_after == 2


def test_queue_limits_and_token_budget_change_on_the_next_add_and_step():
    from engine_core.live_limits import apply_live_limits
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=16)
    add(engine, 1)
    assert engine.queue_rejection(3) is None  # 1 running, up to 1024 may queue
    cfg = engine.scheduler.config
    apply_live_limits(engine, dataclasses.replace(cfg, max_num_queued_requests=0,
                                                  max_num_batched_tokens=4))
    engine.step()
    assert "max_num_queued_requests=0" in engine.queue_rejection(3)
    so = engine.begin_step()
    assert so.total_num_scheduled_tokens <= 4
    engine.end_step(so, engine.executor.execute_model(so))
    outputs = run_to_completion(engine)  # drains under the new budget
    assert outputs["r0"][-1].finished


def test_restart_only_changes_are_refused_by_the_engine_too():
    from engine_core.live_limits import apply_live_limits
    engine = make_engine()
    with pytest.raises(ValueError, match="policy"):
        apply_live_limits(engine, dataclasses.replace(engine.scheduler.config,
                                                      policy="priority"))


def test_speculative_knobs_change_but_k_never_grows_past_start_up():
    from engine_core.live_limits import apply_live_limits
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    engine = make_engine(speculative_config=spec)
    cfg = engine.scheduler.config
    apply_live_limits(engine, cfg, dataclasses.replace(spec, num_speculative_tokens=2,
                                                       prompt_lookup_max=3,
                                                       enable_adaptive=False))
    speculator = engine.scheduler.speculator
    assert speculator.lengths.max_k == 2 and speculator.proposer.max_n == 3
    assert speculator.lengths.next_k("r") == 2
    apply_live_limits(engine, cfg, spec)  # back to the start-up k
    assert speculator.lengths.max_k == 4
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        apply_live_limits(engine, cfg, dataclasses.replace(spec, num_speculative_tokens=5))
