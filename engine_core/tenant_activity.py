"""Which tenants use the engine now or did lately (``scheduler.fair_step_factor``).

A tenant is active while it has requests running or waiting, and for ``WINDOW_S``
after its last one finished: an interactive client sends its next request a moment
after the last answer (or after reading it), and the step in flight when that
request arrives was planned while the tenant had nothing live. Counting it through
the gap lets the fair planner keep steps short for it (fair_step.py).

Just after a tenant's last live request ended, its next one is likeliest: a chat or an
agent loop sends it as soon as the answer is read. For ``FOLLOW_UP_S`` then the steps
are held shorter still (``FOLLOW_UP_FACTOR`` short-prompt steps, Scheduler
.step_bound_ms), so that the request, arriving mid-step, waits about one short step.
The window ends early when the tenant's next request comes.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine_core.request import Tenant

WINDOW_S = 10.0  # a tenant counts this long after it last had a request live
FOLLOW_UP_S = 0.1  # a tenant's next request is expected this long after its last ended
FOLLOW_UP_FACTOR = 1.0  # steps held to this many short-prompt steps meanwhile


class TenantActivity:
    """The last time each tenant had a request live, on the scheduler's clock."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._last_seen: dict[Tenant, float] = {}
        self._idle_since: dict[Tenant, float] = {}  # tenants whose last request ended

    def observe(self, tenants: Iterable[Tenant], now: float) -> None:
        """Record that ``tenants`` have requests live at ``now``."""
        for tenant in tenants:
            self._last_seen[tenant] = now
            self._idle_since.pop(tenant, None)

    def went_idle(self, tenant: Tenant, now: float) -> None:
        """``tenant``'s last live request ended at ``now``."""
        self._last_seen[tenant] = now
        self._idle_since[tenant] = now

    def expects_follow_up(self, now: float) -> bool:
        """Whether some tenant's last request ended within ``FOLLOW_UP_S`` of ``now``
        and no new one has come since."""
        stale = [t for t, since in self._idle_since.items() if now - since > FOLLOW_UP_S]
        for tenant in stale:
            del self._idle_since[tenant]
        return bool(self._idle_since)

    def num_active(self, now: float) -> int:
        """Tenants seen within the window up to ``now`` (older entries are dropped)."""
        horizon = now - self.window_s
        stale = [t for t, seen in self._last_seen.items() if seen < horizon]
        for tenant in stale:
            del self._last_seen[tenant]
        return len(self._last_seen)
