"""The step being planned inside ``Scheduler.schedule``, before it becomes an output."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.request import Request
from engine_core.scheduler_output import (BlockCopy, CachedRequestData, NewRequestData,
                                          SchedulerOutput)


@dataclass(slots=True)
class StepPlan:
    """Requests granted tokens so far this step and the budget left.

    Entries can be withdrawn (``unschedule``) when a request scheduled earlier in the
    step is chosen as a preemption victim; its tokens go back to the budget.
    """

    token_budget: int
    # the time the step is held to (Scheduler.step_bound_ms, read once a step); None: none
    step_bound_ms: float | None = None
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    # req_id -> (request, block ids appended this step)
    cached_reqs: dict[str, tuple[Request, list[int]]] = field(default_factory=dict)
    has_preemption: bool = False
    preempted_req_ids: list[str] = field(default_factory=list)
    # Drafts added to running decodes (engine_core/spec/speculator.py): their count,
    # and their ids when the engine core proposed them.
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Multi-step decoding (engine_core/decode_steps.py): the longest run of decode steps
    # any request was granted; 1: an ordinary step.
    num_decode_steps: int = 1

    def _take(self, request: Request, num_tokens: int) -> None:
        if num_tokens <= 0 or num_tokens > self.token_budget:
            raise ValueError(f"cannot grant {num_tokens} tokens with "
                             f"{self.token_budget} left")
        if request.req_id in self.num_scheduled_tokens:
            raise ValueError(f"request {request.req_id} scheduled twice in one step")
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.token_budget -= num_tokens

    def schedule_new(self, request: Request, num_tokens: int) -> None:
        """Grant tokens to a request the runner holds no state for."""
        self._take(request, num_tokens)
        self.new_reqs.append(request)

    def schedule_cached(self, request: Request, num_tokens: int,
                        new_block_ids: list[int]) -> None:
        """Grant tokens to a request the runner already holds."""
        self._take(request, num_tokens)
        self.cached_reqs[request.req_id] = (request, new_block_ids)

    def add_drafts(self, request: Request, num_drafts: int, new_block_ids: list[int],
                   draft_token_ids: list[int] | None) -> None:
        """Extend a running request's grant by ``num_drafts`` draft tokens to verify
        (``draft_token_ids`` None: the worker's draft model proposes them)."""
        if num_drafts <= 0 or num_drafts > self.token_budget:
            raise ValueError(f"cannot grant {num_drafts} drafts with {self.token_budget} left")
        if request.req_id not in self.cached_reqs or request.req_id in self.num_spec_tokens:
            raise ValueError(f"request {request.req_id} cannot take drafts this step")
        self.num_scheduled_tokens[request.req_id] += num_drafts
        self.token_budget -= num_drafts
        self.cached_reqs[request.req_id][1].extend(new_block_ids)
        self.num_spec_tokens[request.req_id] = num_drafts
        if draft_token_ids is not None:
            self.spec_token_ids[request.req_id] = list(draft_token_ids)

    def add_decode_steps(self, request: Request, num_extra: int,
                         new_block_ids: list[int]) -> None:
        """Extend a running decode's one-token grant to a run of ``1 + num_extra``
        decode steps (engine_core/decode_steps.py)."""
        if num_extra <= 0 or num_extra > self.token_budget:
            raise ValueError(f"cannot grant {num_extra} more steps with "
                             f"{self.token_budget} tokens left")
        if (self.num_scheduled_tokens.get(request.req_id) != 1
                or request.req_id not in self.cached_reqs or self.num_spec_tokens):
            raise ValueError(f"request {request.req_id} cannot run decode steps this step")
        self.num_scheduled_tokens[request.req_id] += num_extra
        self.token_budget -= num_extra
        self.cached_reqs[request.req_id][1].extend(new_block_ids)
        self.num_decode_steps = max(self.num_decode_steps, 1 + num_extra)

    def unschedule(self, request: Request) -> None:
        """Withdraw a grant made earlier this step (no-op if none)."""
        num_tokens = self.num_scheduled_tokens.pop(request.req_id, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        self.cached_reqs.pop(request.req_id, None)
        self.num_spec_tokens.pop(request.req_id, None)
        self.spec_token_ids.pop(request.req_id, None)
        if request in self.new_reqs:
            self.new_reqs.remove(request)

    def build(self, get_block_ids: Callable[[str], list[int]], finished_req_ids: set[str],
              blocks_to_copy: list[BlockCopy],
              take_dropped_blocks: Callable[[str], int] = lambda req_id: 0
              ) -> SchedulerOutput:
        """The SchedulerOutput; ``num_computed_tokens`` are still the pre-step values.

        ``take_dropped_blocks(req_id)``: blocks dropped off the request's table since
        the runner last saw it (KVCacheManager.take_dropped_blocks)."""
        new = [NewRequestData(
            req_id=r.req_id, token_ids=list(r.all_token_ids),
            num_prompt_tokens=r.num_prompt_tokens, sampling_params=r.worker_params,
            block_ids=get_block_ids(r.req_id), num_computed_tokens=r.num_computed_tokens,
            num_output_tokens=r.num_output_tokens, lora_id=r.lora_id) for r in self.new_reqs]
        cached = [CachedRequestData(req_id=r.req_id, new_block_ids=ids,
                                    num_computed_tokens=r.num_computed_tokens,
                                    num_dropped_blocks=take_dropped_blocks(r.req_id))
                  for r, ids in self.cached_reqs.values()]
        # First schedules only: a resumed request reported its hits the first time.
        num_cached = {r.req_id: r.num_cached_tokens for r in self.new_reqs
                      if r.num_preemptions == 0}
        return SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(self.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids, blocks_to_copy=blocks_to_copy,
            num_cached_tokens=num_cached, preempted_req_ids=list(self.preempted_req_ids),
            num_spec_tokens=dict(self.num_spec_tokens),
            spec_token_ids=dict(self.spec_token_ids),
            num_decode_steps=self.num_decode_steps)
