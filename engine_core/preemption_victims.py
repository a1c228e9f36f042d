"""Which running request to preempt: for KV-cache room (every policy) or for share (fair).

Progress guarantee: under ``fcfs`` the latest arrival goes first, so the oldest running
request is preempted only when it runs alone; then it fits the whole pool (requests
that could not are rejected at add) and completes. The fair choices keep that
guarantee by never picking the oldest running request while another one runs.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from engine_core.request import Request
from engine_core.tenant_shares import TenantShares


def age_key(request: Request) -> tuple[float, int]:
    """Arrival order: earlier arrivals sort first."""
    return (request.arrival_time, request.arrival_seq)


def _fair_key(shares: TenantShares) -> Callable[[Request], tuple[float, float, int]]:
    # The tenant most over its share first, then its most recent arrival.
    return lambda r: (shares.excess(r.tenant), r.arrival_time, r.arrival_seq)


def _all_but_oldest(running: Sequence[Request]) -> list[Request]:
    oldest = min(running, key=age_key)
    return [r for r in running if r is not oldest]


def pick_ordered_victim(policy: str, running: Sequence[Request]) -> Request:
    """fcfs: the latest arrival; priority: the largest (priority, arrival) key."""
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time, r.arrival_seq))
    return max(running, key=age_key)


def pick_fair_kv_victim(running: Sequence[Request], shares: TenantShares) -> Request:
    """fair: the latest arrival of the tenant most over its running share, never the
    oldest running request while another runs."""
    if len(running) < 2:
        return running[0]
    return max(_all_but_oldest(running), key=_fair_key(shares))


def pick_share_victim(running: Sequence[Request], shares: TenantShares,
                      protected: Collection[Request],
                      is_usable: Callable[[Request], bool]) -> Request | None:
    """The request to preempt so that a tenant under its share can run, or None.

    Only tenants that keep their share without it give one up
    (``TenantShares.can_give_up``); among them the one most over its share gives its
    most recent arrival. Requests in ``protected`` (admitted this step: no thrash),
    the oldest running request, and requests ``is_usable`` rejects (their slot or
    tokens would not let the newcomer in) are never chosen.
    """
    if len(running) < 2:
        return None
    candidates = [r for r in _all_but_oldest(running)
                  if r not in protected and shares.can_give_up(r.tenant) and is_usable(r)]
    return max(candidates, key=_fair_key(shares), default=None)
