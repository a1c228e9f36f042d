"""One step of the ``fcfs`` and ``priority`` policies: running requests, then waiting ones.

Running requests are granted tokens in running order, preempting for KV room as needed;
then, unless the step preempted, waiting requests start in queue order until the
budget, the slots or the KV cache run out (the first that cannot start stops the rest:
its place in the order is kept).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.preemption_victims import pick_ordered_victim
from engine_core.request import Request, RequestStatus
from engine_core.step_plan import StepPlan

if TYPE_CHECKING:
    from engine_core.scheduler import Scheduler


class OrderedPlanner:
    """Plans each step of the ``fcfs`` and ``priority`` policies."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def plan_step(self, plan: StepPlan) -> None:
        """Fill ``plan`` as the module docstring says."""
        self._schedule_running(plan)
        if not plan.has_preemption:
            self._schedule_waiting(plan)

    def pick_kv_victim(self) -> Request:
        """The running request to preempt for KV room (preemption_victims.py)."""
        s = self.scheduler
        return pick_ordered_victim(s.config.policy, s.running)

    def _schedule_running(self, plan: StepPlan) -> None:
        s = self.scheduler
        for request in list(s.running):
            if plan.token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = s.num_new_tokens(request, request.num_computed_tokens,
                                       plan.token_budget)
            if num_new > 0:
                s.grant_running(request, num_new, plan)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        s = self.scheduler
        while (s.waiting and plan.token_budget > 0
               and len(s.running) < s.config.max_num_seqs):
            if not s.admit(s.waiting.peek(), plan):
                break
