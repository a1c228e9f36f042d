"""Tenants' weights and their fair shares of the running slots (the ``fair`` policy)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine_core.request import Request, Tenant


class TenantWeights:
    """Each live tenant's weight: the ``tenant_weight`` of its newest request.

    The API gives every request of a tenant the same weight; should that change while
    requests are live (a config reload), the newest request speaks for the tenant.
    A tenant is forgotten when its last live request ends.
    """

    def __init__(self) -> None:
        self._weights: dict[Tenant, float] = {}
        self._num_live: Counter[Tenant] = Counter()

    def add(self, request: Request) -> None:
        self._weights[request.tenant] = request.tenant_weight
        self._num_live[request.tenant] += 1

    def remove(self, request: Request) -> bool:
        """Forget one ended request; True when it was its tenant's last live one."""
        tenant = request.tenant
        self._num_live[tenant] -= 1
        if self._num_live[tenant] <= 0:
            del self._num_live[tenant], self._weights[tenant]
            return True
        return False

    def weight(self, tenant: Tenant) -> float:
        """``tenant``'s weight (1.0 for a tenant with no live request)."""
        return self._weights.get(tenant, 1.0)


@dataclass(slots=True)
class TenantShares:
    """Running requests per tenant against each tenant's fair share, for one step.

    ``share(t) = num_slots * w_t / W`` where W sums the weights of the tenants with
    running or waiting work. The tenant set, and so every share, is fixed for the
    step: preempting or admitting moves a request between waiting and running, and
    ``on_preempt`` / ``on_admit`` keep the counts in step with the scheduler's.
    """

    num_slots: int
    weights: dict[Tenant, float]
    num_running: Counter[Tenant]
    total_weight: float = field(init=False)

    def __post_init__(self) -> None:
        self.total_weight = sum(self.weights.values())

    @classmethod
    def measure(cls, num_slots: int, running: Iterable[Request],
                waiting_tenants: Iterable[Tenant],
                weight_of: Callable[[Tenant], float]) -> "TenantShares":
        num_running = Counter(r.tenant for r in running)
        tenants = dict.fromkeys([*num_running, *waiting_tenants])
        return cls(num_slots, {t: weight_of(t) for t in tenants}, num_running)

    def share(self, tenant: Tenant) -> float:
        return self.num_slots * self.weights[tenant] / self.total_weight

    def excess(self, tenant: Tenant) -> float:
        """Running requests beyond the share (negative: under it)."""
        return self.num_running[tenant] - self.share(tenant)

    def is_under(self, tenant: Tenant) -> bool:
        return self.num_running[tenant] < self.share(tenant)

    def can_give_up(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` keeps at least its share with one running request fewer.

        Only such tenants lose requests for share. Together with admitting only for
        tenants under their share, a preemption for share moves both tenants toward
        their shares without crossing them (with fractional shares a tenant may end
        less than one request past it), so sum(|running - share|) strictly falls: two
        tenants can never swap a slot back and forth.
        """
        return self.num_running[tenant] - 1 >= self.share(tenant)

    def most_under(self, heads: Iterable[Request]) -> Request | None:
        """The request whose tenant is furthest under its share (the first of equals),
        or None if no tenant is under it. (Requests, not tenants: None is a tenant.)"""
        under = [r for r in heads if self.is_under(r.tenant)]
        return max(under, key=lambda r: -self.excess(r.tenant), default=None)

    def on_preempt(self, tenant: Tenant) -> None:
        self.num_running[tenant] -= 1

    def on_admit(self, tenant: Tenant) -> None:
        self.num_running[tenant] += 1
