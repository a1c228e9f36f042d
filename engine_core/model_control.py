"""The engine core's side of the RL hooks: sleep state and the quiet window that sleep
and weight updates need.

    LLM / engine-core service ──sleep, wake_up, update_weights, reset_prefix_cache──▶
      1. requests in flight finish (or are aborted when the caller says so); while
         a sleep waits, and while asleep, new requests are refused ("sleeping")
      2. the worker runs the verb (worker/worker_control.py) between steps
      3. every cached prefix is forgotten: its KV was freed (sleep) or computed with
         other weights (update), so no later request may be served from it

The KV pool's blocks are all free once no request is live, so step 3 always succeeds
then. A weight update waits for the same quiet: a request that started on the old
weights must not go on with KV from both.
"""
from __future__ import annotations

from engine_core.sampling_params import InvalidRequestError
from engine_core.scheduler import Scheduler

SLEEPING = "sleeping"  # the error code a refused request carries (HTTP 503)


class EngineSleepingError(InvalidRequestError):
    """A request arrived while the model sleeps (or is about to)."""

    code = SLEEPING


class ModelControl:
    """Sleep level and the quiet window, over one Scheduler (no I/O, no torch)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.level = 0  # 0 awake, 1 KV pool freed, 2 weights freed too
        self.is_sleep_pending = False  # a sleep waits for in-flight requests
        self.num_prefix_resets = 0

    @property
    def is_sleeping(self) -> bool:
        return self.level > 0

    def refusal(self) -> EngineSleepingError | None:
        """Why a new request must be refused now, or None."""
        if self.is_sleeping:
            return EngineSleepingError("the model is asleep (POST /wake_up wakes it)")
        if self.is_sleep_pending:
            return EngineSleepingError("the model is going to sleep")
        return None

    def abort_in_flight(self) -> list[str]:
        """Abort every live request (their final outputs come on the next step)."""
        req_ids = list(self.scheduler.requests)
        self.scheduler.finish_requests(req_ids)
        return req_ids

    def is_quiet(self) -> bool:
        """No request live and no final output undelivered."""
        s = self.scheduler
        return not s.has_unfinished_requests() and not s.has_pending_outputs()

    def forget_prefixes(self) -> None:
        """Drop every cached prefix (all blocks must be free: call when quiet)."""
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("the prefix cache cannot be reset while requests hold "
                               "blocks")
        self.num_prefix_resets += 1

    def on_sleep(self, level: int) -> None:
        """The worker slept: its KV is gone."""
        self.forget_prefixes()
        self.level, self.is_sleep_pending = level, False

    def on_wake(self) -> None:
        self.level = 0

    def on_weights_updated(self) -> None:
        self.forget_prefixes()
