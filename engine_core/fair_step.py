"""One step of the ``fair`` policy: how tenants share the token budget and the slots.

    1. decodes of running requests, oldest first, one token each (as under fcfs); under
       a step bound (``max_step_ms``, or ``fair_step_factor`` while tenants share the
       engine: Scheduler.step_bound_ms) only those predicted to fit, tenants
       interleaved by weight and each tenant's least recently granted first, in half
       the bound's room while prefill work waits: every running request still advances
       every few steps, and a light tenant's decodes every step
    2. caps: the budget left is split over the tenants with prefill work (running
       prefill chunks, waiting requests that could start) by weighted DRR rounds
    3. running prefill chunks, oldest first, each within its tenant's cap
    4. admissions in the waiting queue's DRR order, tenants under their running share
       first, each within its tenant's cap; when the slots or the budget run out,
       preemption for share lets a tenant under its share in
    5. leftovers: budget the caps kept unused goes to running prefills not yet granted,
       then to admissions, uncapped and without preemption (work conservation)

A first token goes first: when a tenant with nothing running has a short request
waiting (its whole prompt within ``FIRST_TOKEN_FRACTION`` of the budget) while other
tenants run, the step is that tenant's alone (every such tenant's head, the budget split
by weight; others' decodes and chunks wait one step). Its first token then costs one
small step, not a step of a flood's decodes and prefill chunks: on a CPU a step of 64
long decodes takes several times a short prompt's. Such steps alternate with ordinary
ones, so the running tenants never lose more than every other step to them, and a
newcomer that cannot start now (no free slot, no KV room) is planned as below.

As under fcfs, a step that preempted for KV room admits nobody. Caps are soft: a grant
withdrawn by a later preemption returns its tokens to the budget, not to the cap, and
step 5 hands them out. Progress: decodes are never lost (a preempted request keeps its
outputs); the oldest running request is never a victim while another runs
(preemption_victims.py) and goes first in its pass (bounded decodes go round robin
instead: each waits at most as many steps as it takes the bound to hold them all); the
split's order rotates between steps, so the rounding remainder (the one token a tiny
cap may need) moves around.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING

from engine_core.preemption_victims import age_key, pick_fair_kv_victim, pick_share_victim
from engine_core.request import Request, RequestStatus, Tenant
from engine_core.step_plan import StepPlan
from engine_core.tenant_shares import TenantShares

if TYPE_CHECKING:
    from engine_core.scheduler import Scheduler


def split_budget(budget: int, demands: dict[Tenant, int],
                 weights: dict[Tenant, float]) -> dict[Tenant, int]:
    """Weighted max-min fair split of ``budget`` tokens over tenants' ``demands``.

    DRR within the step: each round, every tenant with unmet demand is offered a
    quantum in proportion to its weight (at least one token) out of the budget the
    round started with; what it cannot use stays for the next round. No tenant gets
    more than its demand, and the split uses min(budget, total demand). Rounding
    remainders go to tenants in ``demands`` order (the caller rotates it).
    """
    caps = dict.fromkeys(demands, 0)
    active = [t for t, demand in demands.items() if demand > 0]
    while budget > 0 and active:
        total_weight = sum(weights[t] for t in active)
        offer = budget
        for tenant in active:
            quantum = max(1, int(offer * weights[tenant] / total_weight))
            give = min(quantum, demands[tenant] - caps[tenant], budget)
            caps[tenant] += give
            budget -= give
        active = [t for t in active if caps[t] < demands[t]]
    return caps


def _tenant_order(tenant: Tenant) -> tuple[bool, str]:
    return (tenant is not None, tenant or "")


FIRST_TOKEN_FRACTION = 8  # a prompt within budget / 8 tokens is short: its tenant's step


class FairPlanner:
    """Plans each step of the ``fair`` policy through the scheduler's primitives."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._num_steps = 0  # rotates who gets the rounding remainder of the caps
        self._was_first_token_step = False  # such steps alternate with ordinary ones
        self._last_decoded: dict[str, int] = {}  # running decode -> step of its last grant

    def plan_step(self, plan: StepPlan) -> None:
        """Fill ``plan`` following steps 1-5 of the module docstring."""
        s = self.scheduler
        self._num_steps += 1
        was_first_token_step, self._was_first_token_step = self._was_first_token_step, False
        if not was_first_token_step and self._plan_first_tokens(plan):
            self._was_first_token_step = True
            return
        by_age = sorted(s.running, key=age_key)
        decodes = [r for r in by_age if r.is_decoding]
        prefills = [r for r in by_age if not r.is_decoding]
        decodes = self._decodes_within_bound(plan, decodes, bool(prefills or s.waiting))
        self._grant(decodes, plan)
        self._last_decoded = {r.req_id: self._last_decoded.get(r.req_id, -1)
                              for r in s.running}
        for request in decodes:
            if request.req_id in plan.num_scheduled_tokens:
                self._last_decoded[request.req_id] = self._num_steps
        caps = self._caps(plan, prefills, self.measure_shares())
        self._grant(prefills, plan, caps)
        is_kv_preempted = plan.has_preemption
        admitted: set[Request] = set()
        if not is_kv_preempted:
            self._admit_waiting(plan, self.measure_shares(), caps, admitted)
        self._grant(prefills, plan, may_preempt=False)
        if not is_kv_preempted:
            self._admit_waiting(plan, self.measure_shares(), None, admitted)

    def _decodes_within_bound(self, plan: StepPlan, decodes: list[Request],
                              has_prefill_work: bool) -> list[Request]:
        """The decodes this step runs: all of them, or under a step bound
        (``plan.step_bound_ms``) those predicted to fit it, least recently granted
        first, tenants interleaved, with ``plan``'s budget resized beside them. A step's
        fixed cost is taken as a short prompt's step alone (StepCost.short_step_ms;
        until one was measured, decodes are not cut). While prefill work waits the
        decodes get half of the bound above that cost, the prefills the rest (step 1
        of the module docstring)."""
        s = self.scheduler
        bound, base_ms = plan.step_bound_ms, s.step_cost.short_step_ms
        if bound is None or base_ms is None or len(decodes) <= 1:
            return decodes
        decode_ms = (base_ms + (bound - base_ms) / 2 if has_prefill_work and bound > base_ms
                     else bound)
        order = self._decode_order(decodes)
        num = s.step_cost.decodes_within(decode_ms, [r.num_computed_tokens for r in order],
                                         base_ms)
        if num is None or num >= len(order):
            return decodes
        chosen = order[:num]
        plan.token_budget = s.token_budget(bound, chosen)
        return chosen

    def _decode_order(self, decodes: list[Request]) -> list[Request]:
        """Decodes in the order a bound takes them: tenants interleaved by weight
        (the tenant with the fewest taken per unit of weight next), each tenant's
        least recently granted first."""
        s = self.scheduler
        queues: dict[Tenant, deque[Request]] = {}
        for request in sorted(decodes, key=lambda r: (self._last_decoded.get(r.req_id, -1),
                                                      age_key(r))):
            queues.setdefault(request.tenant, deque()).append(request)
        taken = dict.fromkeys(queues, 0)
        order = []
        while queues:
            tenant = min(queues, key=lambda t: ((taken[t] + 1) / s.tenant_weights.weight(t),
                                                _tenant_order(t)))
            queue = queues[tenant]
            order.append(queue.popleft())
            taken[tenant] += 1
            if not queue:
                del queues[tenant]
        return order

    def _plan_first_tokens(self, plan: StepPlan) -> bool:
        """A step of the newcomers' short requests alone (module docstring); False,
        leaving ``plan`` untouched, when there is none to plan."""
        s = self.scheduler
        running = {r.tenant for r in s.running}
        if not running:
            return False  # nobody would wait for it: the ordinary plan is the same
        short = s.config.max_num_batched_tokens // FIRST_TOKEN_FRACTION
        heads = {t: s.waiting.head(t) for t in s.waiting.tenants() if t not in running}
        remaining = {t: r.num_tokens - r.num_computed_tokens for t, r in heads.items()}
        order = sorted((t for t in heads if remaining[t] <= short), key=_tenant_order)
        if not order:
            return False
        k = self._num_steps % len(order)
        order = order[k:] + order[:k]
        # Nobody else runs in this step: a budget lowered for max_step_ms (sized
        # beside the running decodes) does not apply to it.
        lowered, plan.token_budget = plan.token_budget, s.config.max_num_batched_tokens
        caps = split_budget(plan.token_budget, {t: remaining[t] for t in order},
                            {t: s.tenant_weights.weight(t) for t in order})
        admitted = False
        for tenant in order:
            if len(s.running) >= s.config.max_num_seqs:
                break
            admitted |= s.admit(heads[tenant], plan, caps[tenant])
        if not admitted:
            plan.token_budget = lowered
        return admitted

    def measure_shares(self) -> TenantShares:
        """Running requests per tenant against their fair shares, as of now."""
        s = self.scheduler
        return TenantShares.measure(s.config.max_num_seqs, s.running, s.waiting.tenants(),
                                    s.tenant_weights.weight)

    def pick_kv_victim(self) -> Request:
        """The running request to preempt for KV room (preemption_victims.py)."""
        return pick_fair_kv_victim(self.scheduler.running, self.measure_shares())

    def _grant(self, requests: Iterable[Request], plan: StepPlan,
               caps: dict[Tenant, int] | None = None, may_preempt: bool = True) -> None:
        s = self.scheduler
        for request in requests:
            if plan.token_budget == 0:
                return
            if (request.status is not RequestStatus.RUNNING
                    or request.req_id in plan.num_scheduled_tokens):
                continue  # preempted in this step, or granted in an earlier pass
            limit = plan.token_budget if caps is None else min(
                plan.token_budget, caps.get(request.tenant, 0))
            num_new = s.num_new_tokens(request, request.num_computed_tokens, limit)
            if (num_new > 0 and s.grant_running(request, num_new, plan, may_preempt)
                    and caps is not None):
                caps[request.tenant] -= num_new

    def _caps(self, plan: StepPlan, prefills: list[Request],
              shares: TenantShares) -> dict[Tenant, int]:
        """Each tenant's share of the budget for prefill work (step 2)."""
        s = self.scheduler
        demands: Counter[Tenant] = Counter()
        for request in prefills:
            if request.status is RequestStatus.RUNNING:
                demands[request.tenant] += s.num_new_tokens(
                    request, request.num_computed_tokens, plan.token_budget)
        num_free = s.config.max_num_seqs - len(s.running)
        for tenant in s.waiting.tenants():
            # Requests that could start now: one per free slot, or one that would
            # take a slot by preemption for share.
            num_startable = num_free if num_free > 0 else int(shares.is_under(tenant))
            demands[tenant] += sum(r.num_tokens - r.num_computed_tokens
                                   for r in islice(s.waiting.waiting_of(tenant), num_startable))
        order = sorted(demands, key=_tenant_order)
        if order:
            k = self._num_steps % len(order)
            order = order[k:] + order[:k]
        return split_budget(plan.token_budget, {t: demands[t] for t in order},
                            {t: s.tenant_weights.weight(t) for t in order})

    def _admit_waiting(self, plan: StepPlan, shares: TenantShares,
                       caps: dict[Tenant, int] | None, admitted: set[Request]) -> None:
        """Admissions (step 4 with ``caps``, step 5 without: no preemption then)."""
        s = self.scheduler
        blocked: set[Tenant] = set()  # tenants whose head cannot start this step
        while s.waiting:
            if len(s.running) >= s.config.max_num_seqs or plan.token_budget == 0:
                if caps is None:
                    return
                request, need = self._make_room(plan, shares, admitted, blocked)
                if request is None or not s.admit(
                        request, plan, max(need, caps.get(request.tenant, 0))):
                    return  # nothing to gain, or the room made did not suffice
            else:
                request = self._next_admission(shares, caps, blocked)
                if request is None:
                    return
                limit = None if caps is None else caps.get(request.tenant, 0)
                if not s.admit(request, plan, limit):
                    blocked.add(request.tenant)
                    continue
            admitted.add(request)
            shares.on_admit(request.tenant)
            if caps is not None:
                granted = plan.num_scheduled_tokens[request.req_id]
                caps[request.tenant] = max(0, caps.get(request.tenant, 0) - granted)

    def _next_admission(self, shares: TenantShares, caps: dict[Tenant, int] | None,
                        blocked: set[Tenant]) -> Request | None:
        """The head of the tenant the DRR serves next among those that may start now;
        tenants under their running share go before the others."""
        waiting = self.scheduler.waiting
        tenants = waiting.tenants()
        eligible = [t for t in tenants
                    if t not in blocked and (caps is None or caps.get(t, 0) > 0)]
        eligible = [t for t in eligible if shares.is_under(t)] or eligible
        return waiting.peek_among(exclude=set(tenants) - set(eligible))

    def _make_room(self, plan: StepPlan, shares: TenantShares, admitted: set[Request],
                   blocked: set[Tenant]) -> tuple[Request | None, int]:
        """Preempt for share: when a waiting tenant is under its share of the slots,
        preempt one request of the tenant most over its share (preemption_victims.py)
        and return the under-share tenant's head to admit in its place, with the
        fewest tokens it must be granted; (None, 0) when there is no such pair."""
        s = self.scheduler
        request = shares.most_under(s.waiting.head(t) for t in s.waiting.tenants()
                                    if t not in blocked)
        if request is None:
            return None, 0
        remaining = request.num_tokens - request.num_computed_tokens
        is_whole = (not s.config.enable_chunked_prefill
                    and remaining <= s.config.max_num_batched_tokens)
        need = remaining if is_whole else 1  # tokens the newcomer must be granted

        def may_give_way(victim: Request) -> bool:
            freed = plan.num_scheduled_tokens.get(victim.req_id, 0)
            return (plan.token_budget + freed >= need
                    and not s.kv_cache_manager.lends_pending_blocks(victim))

        victim = pick_share_victim(s.running, shares, admitted, may_give_way)
        if victim is None:
            return None, 0
        s.preempt(victim, plan)
        shares.on_preempt(victim.tenant)
        return request, need
