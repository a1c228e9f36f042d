"""Continuous batching: which requests compute how many tokens in the next step.

One counter drives progress. Each step grants a request up to
``num_tokens - num_computed_tokens`` tokens under the shared token budget; prefill
chunks, decodes, recompute after preemption and forked samples are the same case.
``num_computed_tokens`` advances when a step is scheduled (the runner computes
exactly what it is told), so a sampled token only has to be appended afterwards;
with speculative decoding it steps back over drafts the runner rejected
(engine_core/spec/speculator.py).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from config.lora import LoRAConfig
from config.schema import CacheConfig, SchedulerConfig
from config.speculative import SpeculativeConfig
from engine_core.decode_steps import grant_decode_steps, is_plain_run, steps_within
from engine_core.fair_queue import FairQueue
from engine_core.fair_step import FairPlanner
from engine_core.fork_tracker import ForkTracker
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.lora_admission import LoRAAdmission
from engine_core.ordered_step import OrderedPlanner
from engine_core.output_deltas import append_tokens, make_delta
from engine_core.outputs import EngineCoreOutput, ModelRunnerOutput
from engine_core.request import Request, RequestStatus
from engine_core.request_limits import RequestLimits
from engine_core.request_queue import RequestQueue
from engine_core.sampling_params import InvalidRequestError
from engine_core.scheduler_output import SchedulerOutput
from engine_core.spec.speculator import speculator_for
from engine_core.step_cost import SHORT_PROMPT_TOKENS, StepCost, StepShape
from engine_core.step_plan import StepPlan
from engine_core.tenant_activity import FOLLOW_UP_FACTOR, TenantActivity
from engine_core.tenant_shares import TenantWeights


class Scheduler:
    """Plans steps (``schedule``) and applies their results (``update_from_output``).

    No I/O. Waiting samples of an n > 1 request that hold forked blocks are "parked";
    their blocks are reclaimed before any running request is preempted, so parked
    blocks can never starve the requests that are making progress.

    A planner per policy family decides what each step grants (ordered_step.py for
    fcfs and priority, fair_step.py for fair) through the primitives below:
    ``grant_running``, ``admit`` and ``preempt``. With LoRA on, ``lora``
    (lora_admission.py) parks requests until their adapter is loaded and holds each
    step to ``max_loras`` adapters.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, block_size: int, max_model_len: int,
                 lora_config: LoRAConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None):
        self.config = scheduler_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, max_model_len,
            cache_config.enable_prefix_caching, cache_config.hash_algorithm)
        self.requests: dict[str, Request] = {}
        self.tenant_weights = TenantWeights()
        self.planner: OrderedPlanner | FairPlanner
        if scheduler_config.policy == "fair":
            # A turn of the waiting queue is worth one step's budget per unit of weight.
            self.waiting: RequestQueue | FairQueue = FairQueue(
                scheduler_config.max_num_batched_tokens, self.tenant_weights.weight)
            self.planner = FairPlanner(self)
        else:
            self.waiting = RequestQueue(scheduler_config.policy)
            self.planner = OrderedPlanner(self)
        self.running: list[Request] = []
        self.forks = ForkTracker(self.kv_cache_manager)
        self.limits = RequestLimits(max_model_len, num_blocks, block_size,
                                    scheduler_config.max_num_batched_tokens,
                                    scheduler_config.enable_chunked_prefill)
        self.lora = (LoRAAdmission(lora_config)
                     if lora_config is not None and lora_config.enable_lora else None)
        self.speculator = speculator_for(speculative_config, self.kv_cache_manager,
                                         max_model_len)
        self.num_preemptions = 0
        # Step times, learned always so that a retune to a max_step_ms acts at once.
        self.step_cost = StepCost()
        self.tenant_activity = TenantActivity()
        self.clock = time.monotonic
        # (the step, its shape, its start, its decode steps): one step's time is learned
        self._timed_step: tuple[SchedulerOutput, StepShape, float, int] | None = None
        self._children: dict[str, list[str]] = {}  # parent id -> live sample ids
        self._runner_req_ids: set[str] = set()  # requests the runner holds state for
        self._finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []
        self._arrival_seq = itertools.count()

    # ---- admission ---------------------------------------------------------------

    def check_request_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """``max_tokens`` filled in; InvalidRequestError if the request could never be
        served (engine_core/request_limits.py)."""
        return self.limits.check(num_prompt_tokens, max_tokens)

    def add_request(self, request: Request) -> None:
        """Queue a request (or park an n > 1 sample until it can fork)."""
        if request.req_id in self.requests:
            raise InvalidRequestError(f"request id {request.req_id!r} is in use", "req_id")
        max_tokens = self.check_request_fits(request.num_prompt_tokens,
                                             request.sampling_params.max_tokens)
        if request.sampling_params.max_tokens is None:
            request.sampling_params = request.sampling_params.clone(max_tokens=max_tokens)
        if request.lora_id:
            if self.lora is None:
                raise InvalidRequestError("LoRA adapters are off (lora.enable_lora)",
                                          "lora_id")
            self.lora.acquire(request)
        request.arrival_seq = next(self._arrival_seq)
        self.requests[request.req_id] = request
        self.tenant_weights.add(request)
        if request.parent_req_id is not None:
            self._children.setdefault(request.parent_req_id, []).append(request.req_id)
        if not self.forks.add(request) and not self._parks_for_lora(request):
            request.status = RequestStatus.WAITING
            self.waiting.add(request)

    def _parks_for_lora(self, request: Request) -> bool:
        """Park a request whose adapter is not loaded (lora_admission.py)."""
        return bool(request.lora_id) and self.lora.park_if_unloaded(request)

    def is_known_id(self, req_id: str) -> bool:
        """Whether ``req_id`` names a live request or the parent of live samples."""
        return req_id in self.requests or req_id in self._children

    # ---- schedule ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (the policy's planner decides the grants)."""
        if self.config.policy == "fair":
            self.tenant_activity.observe({r.tenant for r in self.running}
                                         | set(self.waiting.tenants()), self.clock())
        bound = self.step_bound_ms()  # once a step: the planner reads it off the plan
        plan = StepPlan(token_budget=self.token_budget(bound), step_bound_ms=bound)
        if self.lora is not None:
            for request in reversed(self.lora.begin_step(self.running)):
                self.waiting.add_front(request)
        self.planner.plan_step(plan)
        if self.speculator is not None:
            self.speculator.grant_drafts(plan, self.running)
        else:
            self._grant_decode_steps(plan)
        shape = self._shape_of(plan)
        out = self._make_output(plan)
        self._timed_step = (out, shape, self.clock(), plan.num_decode_steps)
        return out

    def _grant_decode_steps(self, plan: StepPlan) -> None:
        """Turn a step of plain decodes into a run of up to ``num_scheduler_steps``
        when nobody waits (engine_core/decode_steps.py)."""
        if (self.config.num_scheduler_steps <= 1 or self.num_waiting
                or not is_plain_run(plan, self.running)):
            return
        max_run_ms = min((b for b in (plan.step_bound_ms, self.config.max_run_ms)
                          if b is not None), default=None)
        num_steps = steps_within(self.config.num_scheduler_steps, max_run_ms, self.step_cost,
                                 self.running)
        if num_steps > 1:
            grant_decode_steps(plan, self.running, num_steps, self.kv_cache_manager,
                               self.max_model_len)

    def step_bound_ms(self) -> float | None:
        """The time this step is held to: ``max_step_ms``, and under ``fair`` while
        two or more tenants are active (tenant_activity.py) ``fair_step_factor``
        times the measured step of a short prompt alone (StepCost.short_step_ms): a
        newcomer then waits at most about that many of its own steps for the step in
        flight; ``FOLLOW_UP_FACTOR`` times it just after a tenant's last request ended
        (tenant_activity.py: its next one is likeliest then); the smaller of the two;
        None: no bound, as always with chunked prefill off (a prompt must then go
        whole: a lowered budget would starve it)."""
        if not self.config.enable_chunked_prefill:
            return None
        bound = self.config.max_step_ms
        factor = self.config.fair_step_factor
        short_ms = self.step_cost.short_step_ms
        now = self.clock()
        if (self.config.policy == "fair" and factor > 0 and short_ms is not None
                and self.tenant_activity.num_active(now) >= 2):
            if self.tenant_activity.expects_follow_up(now):
                factor = min(factor, FOLLOW_UP_FACTOR)
            bound = factor * short_ms if bound is None else min(bound, factor * short_ms)
        return bound

    def token_budget(self, bound: float | None,
                     decodes: list[Request] | None = None) -> int:
        """This step's token budget: ``max_num_batched_tokens``, or under a step bound
        (``step_bound_ms``) the ``decodes`` (default: every running decode) plus the
        prefill tokens predicted to fit beside them (engine_core/step_cost.py)."""
        budget = self.config.max_num_batched_tokens
        if bound is None:
            return budget
        if decodes is None:
            decodes = [r for r in self.running if r.is_decoding]
        num_prefill = self.step_cost.prefill_tokens_within(
            bound, len(decodes), sum(r.num_computed_tokens for r in decodes),
            self.block_size)
        return budget if num_prefill is None else min(budget, len(decodes) + num_prefill)

    def _shape_of(self, plan: StepPlan) -> StepShape:
        """The plan's prefill and decode tokens (before num_computed_tokens moves); of
        one step of a run of decode steps."""
        if plan.num_decode_steps > 1:
            decodes = [self.requests[r] for r in plan.num_scheduled_tokens]
            return StepShape(0, len(decodes), sum(r.num_computed_tokens for r in decodes))
        num_prefill = num_decode = context = 0
        for req_id, num in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if num - plan.num_spec_tokens.get(req_id, 0) <= 1 and request.is_decoding:
                num_decode += num
                context += request.num_computed_tokens
            else:
                num_prefill += num
        return StepShape(num_prefill, num_decode, context, self._is_short_prompt_alone(plan))

    def _is_short_prompt_alone(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is one newcomer's whole short prompt and nothing else
        (StepShape.is_short_prompt_alone)."""
        if len(plan.num_scheduled_tokens) != 1 or len(plan.new_reqs) != 1:
            return False
        request = plan.new_reqs[0]
        num = plan.num_scheduled_tokens.get(request.req_id, 0)
        return (0 < num <= SHORT_PROMPT_TOKENS
                and request.num_computed_tokens + num == request.num_tokens)

    def num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens ``request`` can compute from ``num_computed`` within ``budget``."""
        return min(request.num_tokens - num_computed, budget,
                   self.max_model_len - num_computed)

    def grant_running(self, request: Request, num_new: int, plan: StepPlan,
                      may_preempt: bool = True) -> bool:
        """Grant ``num_new`` tokens to a running request, making KV room by reclaiming
        parked samples, then (``may_preempt``) by preempting the policy's victims;
        False when it got nothing (it did not fit, or was itself the victim)."""
        while (new_blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
            if self.forks.reclaim():
                continue
            if not may_preempt:
                return False
            victim = self.planner.pick_kv_victim()
            self.preempt(victim, plan)
            if victim is request:
                return False
        plan.schedule_cached(request, num_new, new_blocks.get_block_ids())
        return True

    def preempt(self, victim: Request, plan: StepPlan) -> None:
        """Preempt a running request by recompute: it keeps its outputs, frees its
        blocks, loses any grant of this step and waits at the front of its queue."""
        plan.unschedule(victim)
        plan.has_preemption = True
        plan.preempted_req_ids.append(victim.req_id)
        self.running.remove(victim)
        # free() reads num_computed_tokens (start of step) before it is reset.
        self.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(victim)
        self._forget_runner_state(victim)

    def admit(self, request: Request, plan: StepPlan, budget: int | None = None) -> bool:
        """Start the waiting request the queue offered, granting it at most ``budget``
        tokens (default: the plan's); False, leaving it queued, if it cannot start."""
        if self.lora is not None and not self.lora.may_admit(request):
            return False
        budget = plan.token_budget if budget is None else min(budget, plan.token_budget)
        kv = self.kv_cache_manager
        # prompt logprobs need every prompt token's logits: no prefix-cache hits
        is_lookup = request.num_computed_tokens == 0 and not request.wants_prompt_logprobs
        hits, num_hit = kv.get_computed_blocks(request, record_stats=False) if is_lookup \
            else (None, 0)
        num_computed = request.num_computed_tokens + num_hit
        remaining = request.num_tokens - num_computed
        # Chunking off: a whole remainder must fit this step. A resumed request longer
        # than the whole budget (prompts that long are rejected at add) is chunked.
        if (not self.config.enable_chunked_prefill
                and budget < remaining <= self.config.max_num_batched_tokens):
            return False
        num_new = self.num_new_tokens(request, num_computed, budget)
        while kv.allocate_slots(request, num_new, num_hit, hits) is None:
            if not self.forks.reclaim(keep=request):
                return False
        self.waiting.take(request, num_new)
        self.forks.unpark(request)
        if is_lookup:
            kv.record_prefix_query(request, num_hit)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if self.lora is not None:
            self.lora.on_admit(request)
        plan.schedule_new(request, num_new)
        return True

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        kv = self.kv_cache_manager
        out = plan.build(kv.get_block_ids, self._finished_req_ids,
                         self.forks.take_block_copies(), kv.take_dropped_blocks)
        self._finished_req_ids = set()
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self._runner_req_ids.update(new.req_id for new in out.scheduled_new_reqs)
        return out

    # ---- update ------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, fork samples; return the deltas.

        Final outputs of requests finished by ``finish_requests`` since the previous
        call come first. Scheduled requests that sampled nothing emit nothing.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._timed_step is not None and self._timed_step[0] is scheduler_output:
            _, shape, started, num_steps = self._timed_step
            if shape.num_prefill_tokens + shape.num_decode_tokens > 0:
                self.step_cost.observe(shape, (self.clock() - started) * 1000.0 / num_steps)
        self._timed_step = None
        mro = model_runner_output
        position = {req_id: i for i, req_id in enumerate(mro.req_ids)}
        report = mro.structured_output
        deferred = set(report.deferred_req_ids) if report is not None else ()
        grammar_ended = set(report.ended_req_ids) if report is not None else ()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if req_id in deferred:  # its grammar is compiling: compute the token again
                request.num_computed_tokens -= 1
            chunk = mro.prompt_logprobs.get(req_id)
            if chunk is not None and request.num_output_tokens == 0:
                # each prompt token counts once: a recompute after preemption adds
                # only what the request does not hold yet
                wanted = len(request.prompt_logprobs) + 1
                if chunk.start <= wanted < chunk.start + len(chunk.logprobs):
                    request.prompt_logprobs.extend(chunk.logprobs[wanted - chunk.start:])
            i = position.get(req_id)
            sampled = mro.sampled_token_ids[i] if i is not None else []
            if req_id in scheduler_output.num_spec_tokens:
                self.speculator.on_verified(
                    request, scheduler_output.num_spec_tokens[req_id], len(sampled))
            # Fork before stop checks: the source may finish (and free) right now.
            self._fork_waiters(request)
            if not sampled:
                continue
            logprobs = mro.logprobs[i] if i < len(mro.logprobs) else None
            out, status = append_tokens(request, sampled, logprobs, self.max_model_len,
                                        req_id in grammar_ended)
            if status is not None:
                self._finish(request, status)
                out.finish_reason = request.finish_reason
            outputs.append(out)
        return outputs

    def _fork_waiters(self, source: Request) -> None:
        for child in reversed(self.forks.fork_ready(source)):
            self.waiting.add_front(child)

    # ---- finishing ---------------------------------------------------------------

    def finish_requests(self, req_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests from outside (abort, stop string). A parent id ends all samples.

        Each ended request gets a final output (no tokens, its finish reason) from the
        next ``update_from_output``. Unknown or finished ids are ignored.
        """
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        for req_id in req_ids:
            targets = [req_id] if req_id in self.requests else list(
                self._children.get(req_id, ()))
            for target in targets:
                request = self.requests.get(target)
                if request is None:
                    continue
                out = make_delta(request, [], request.num_output_tokens == 0)
                self._finish(request, status)
                out.finish_reason = request.finish_reason
                self._pending_outputs.append(out)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        promoted = self.forks.remove(request)
        if promoted is not None and not self._parks_for_lora(promoted):
            self.waiting.add_front(promoted)
        if request.lora_id:  # a parked request leaves the park here
            self.lora.release(request)
        request.status = status
        request.finish_reason = status.finish_reason
        self.kv_cache_manager.free(request)
        if self.speculator is not None:
            self.speculator.forget(request)
        self._forget_runner_state(request)
        del self.requests[request.req_id]
        if self.tenant_weights.remove(request) and self.config.policy == "fair":
            self.tenant_activity.went_idle(request.tenant, self.clock())
        if request.parent_req_id is not None:
            siblings = self._children[request.parent_req_id]
            siblings.remove(request.req_id)
            if not siblings:
                del self._children[request.parent_req_id]

    def _forget_runner_state(self, request: Request) -> None:
        if request.req_id in self._runner_req_ids:
            self._runner_req_ids.discard(request.req_id)
            self._finished_req_ids.add(request.req_id)

    # ---- counters ----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests plus samples waiting to fork or for their adapter."""
        parked = self.lora.num_parked if self.lora is not None else 0
        return len(self.waiting) + self.forks.num_waiters + parked

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens of the requests in the waiting queue (prompt, plus outputs of
        preempted ones) and of those parked for their adapter."""
        parked = self.lora.num_parked_tokens if self.lora is not None else 0
        return self.waiting.num_tokens + parked

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_pending_outputs(self) -> bool:
        """Final outputs of ended requests wait for the next ``update_from_output``."""
        return bool(self._pending_outputs)
