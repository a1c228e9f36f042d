"""Which tenants use the engine now or did lately (``scheduler.fair_step_factor``).

A tenant is active while it has requests running or waiting, and for ``WINDOW_S``
after its last one finished: an interactive client sends its next request a moment
after the last answer (or after reading it), and the step in flight when that
request arrives was planned while the tenant had nothing live. Counting it through
the gap lets the fair planner keep steps short for it (fair_step.py).
"""
from __future__ import annotations

from collections.abc import Iterable

from engine_core.request import Tenant

WINDOW_S = 10.0  # a tenant counts this long after it last had a request live


class TenantActivity:
    """The last time each tenant had a request live, on the scheduler's clock."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._last_seen: dict[Tenant, float] = {}

    def observe(self, tenants: Iterable[Tenant], now: float) -> None:
        """Record that ``tenants`` have requests live at ``now``."""
        for tenant in tenants:
            self._last_seen[tenant] = now

    def num_active(self, now: float) -> int:
        """Tenants seen within the window up to ``now`` (older entries are dropped)."""
        horizon = now - self.window_s
        stale = [t for t, seen in self._last_seen.items() if seen < horizon]
        for tenant in stale:
            del self._last_seen[tenant]
        return len(self._last_seen)
