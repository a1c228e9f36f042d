"""Swap an engine's live scheduler and speculative-decoding settings between two steps.

The keys config/live_config.py calls live are those read afresh at every ``schedule()``
(``max_num_seqs``, the token budget), at every add (the queue limits, the fit check's
budget) or at every draft grant (the speculative knobs), so swapping the objects that
hold them between steps is all a retune needs: requests already running keep their
blocks and state, and the next step plans under the new limits. Lowering
``max_num_seqs`` below the running count preempts nobody: running requests finish and
no new one is admitted until the batch is under the new limit.

The caller (the engine core service, or a test) has already refused every key that is
not live, so the policy, the chunked-prefill switch and the speculative method are the
same in ``scheduler_config``/``speculative_config`` as in the running engine.
"""
from __future__ import annotations

from dataclasses import replace

from config.schema import SchedulerConfig
from config.speculative import SpeculativeConfig
from engine_core.engine import EngineCore
from engine_core.fair_queue import FairQueue
from engine_core.queue_limits import QueueLimits


def apply_live_limits(engine: EngineCore, scheduler_config: SchedulerConfig,
                      speculative_config: SpeculativeConfig | None = None) -> None:
    """Make ``engine``'s next step and next add use these settings."""
    scheduler = engine.scheduler
    old = scheduler.config
    if (scheduler_config.policy != old.policy
            or scheduler_config.enable_chunked_prefill != old.enable_chunked_prefill):
        raise ValueError("scheduler.policy and scheduler.enable_chunked_prefill are "
                         "restart-only")
    speculator = scheduler.speculator
    if speculator is not None and speculative_config is not None:  # all checks first
        if speculative_config.method != speculator.config.method:
            raise ValueError("speculative.method is restart-only")
        # per-position counters were sized for the start-up k
        if (speculative_config.num_speculative_tokens
                > len(speculator.stats.num_accepted_tokens_per_pos)):
            raise ValueError("speculative.num_speculative_tokens may not grow past its "
                             "start-up value")
    scheduler.config = scheduler_config
    scheduler.limits = replace(scheduler.limits,
                               max_num_batched_tokens=scheduler_config.max_num_batched_tokens)
    if isinstance(scheduler.waiting, FairQueue):  # a turn is worth one step's budget
        scheduler.waiting.base_quantum = float(scheduler_config.max_num_batched_tokens)
    engine.queue_limits = QueueLimits.from_config(scheduler_config)
    if speculator is None or speculative_config is None:
        return
    speculator.config = speculative_config
    speculator.lengths.max_k = speculative_config.num_speculative_tokens
    speculator.lengths.is_adaptive = speculative_config.enable_adaptive
    if speculator.proposer is not None:
        speculator.proposer.min_n = speculative_config.prompt_lookup_min
        speculator.proposer.max_n = speculative_config.prompt_lookup_max
