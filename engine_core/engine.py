"""EngineCore: validates requests, expands n > 1, and runs schedule -> execute -> update."""
from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from config.lora import LoRAConfig
from config.schema import CacheConfig, SchedulerConfig
from config.speculative import SpeculativeConfig
from engine_core.lora_control import LoRAControl, LoRAExecutor, LoRAStats
from engine_core.model_control import ModelControl
from engine_core.model_facts import ModelFacts
from engine_core.outputs import EngineCoreOutput, ModelRunnerOutput
from engine_core.queue_limits import AdmittedBatches, QueueLimits
from engine_core.request import Request
from engine_core.request_fields import check_prompt, check_tenant, check_vocabulary
from engine_core.sampling_params import InvalidRequestError, SamplingParams
from engine_core.scheduler import Scheduler
from engine_core.scheduler_output import SchedulerOutput
from engine_core.spec.speculator import DraftOutcome, SpecDecodeStats

MAX_REQ_ID_CHARS = 256  # ids travel in every step that names the request: keep them small


class ModelExecutor(Protocol):
    """Runs one planned step on the model and returns what it sampled.

    Contract: apply ``finished_req_ids`` first, then new/cached request data, then
    ``blocks_to_copy``, then the forward; a request samples only when its computed
    tokens reach the end of its known tokens. A step may schedule zero tokens (it then
    only carries finished ids or block copies).
    """

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class EngineCoreStats:
    """A snapshot of the engine core's gauges and counters."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # tokens of the requests in the waiting queue
    num_preemptions: int  # since start
    kv_cache_usage: float  # fraction of usable blocks owned by requests
    prefix_cache_queries: int  # tokens looked up, since start
    prefix_cache_hits: int  # of those, tokens found cached
    lora: LoRAStats | None = None  # adapters of running and waiting requests (LoRA on)
    spec_decode: SpecDecodeStats | None = None  # since start; None: speculation is off


def _has_work(so: SchedulerOutput) -> bool:
    return so.total_num_scheduled_tokens > 0 or bool(so.finished_req_ids or so.blocks_to_copy)


class EngineCore:
    """The engine loop without I/O: add and abort requests, call ``step()``.

    Aborts are answered on the next ``step()``: each aborted request yields one final
    EngineCoreOutput with no tokens and ``finish_reason`` ABORT, even when nothing else
    runs in that step.

    With LoRA on, ``lora`` (lora_control.py) registers and resolves adapters; in one
    process ``lora_executor`` (the worker's LoRA manager) receives its commands.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, block_size: int, max_model_len: int,
                 executor: ModelExecutor, eos_token_ids: Sequence[int] = (),
                 vocab_size: int | None = None, lora_config: LoRAConfig | None = None,
                 lora_executor: LoRAExecutor | None = None, *,
                 speculative_config: SpeculativeConfig | None = None):
        self.scheduler = Scheduler(scheduler_config, cache_config, num_blocks, block_size,
                                   max_model_len, lora_config, speculative_config)
        self.lora = LoRAControl(self.scheduler.lora) if self.scheduler.lora else None
        self.control = ModelControl(self.scheduler)  # sleep state (model_control.py)
        self.lora_executor = lora_executor
        self.queue_limits = QueueLimits.from_config(scheduler_config)
        self.admitted_batches = AdmittedBatches()
        self.executor = executor
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size

    @classmethod
    def from_model_facts(cls, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                         facts: ModelFacts, executor: ModelExecutor | None,
                         lora_config: LoRAConfig | None = None,
                         lora_executor: LoRAExecutor | None = None,
                         speculative_config: SpeculativeConfig | None = None
                         ) -> "EngineCore":
        """The engine core for a loaded model (``executor`` None: the caller runs each
        step's plan elsewhere, between ``begin_step`` and ``end_step``)."""
        return cls(scheduler_config, cache_config, facts.num_blocks, facts.block_size,
                   facts.max_model_len, executor, facts.eos_token_ids, facts.vocab_size,
                   lora_config, lora_executor, speculative_config=speculative_config)

    def add_request(self, req_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_id: int = 0, *, tenant: str | None = None,
                    tenant_weight: float = 1.0, batch_id: str | None = None) -> list[str]:
        """Validate and queue a request; returns the engine ids of its samples.
        ``batch_id``: see ``queue_rejection``.

        n > 1 becomes n samples ``f"{i}_{req_id}"`` (their outputs carry
        ``parent_req_id`` and ``index``); with a seed, sample i uses ``seed + i``.
        Every sample counts against ``tenant`` (None: the anonymous tenant) with
        ``tenant_weight`` under the ``fair`` policy.
        Raises InvalidRequestError naming the offending field. Whether the request fits
        (and its default ``max_tokens``) is the scheduler's call: every sample shares
        the prompt and ``max_tokens``, so if the first is refused none was queued.
        """
        prompt = list(prompt_token_ids)
        params = self._checked_fields(prompt, sampling_params, cache_salt, lora_id,
                                      tenant, tenant_weight)
        self._validate_ids(req_id, params.n)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.n == 1:
            samples = [(req_id, params, None, 0)]
        else:
            samples = [(f"{i}_{req_id}", self._sample_params(params, i), req_id, i)
                       for i in range(params.n)]
        for sample_id, sample_params, parent_id, index in samples:
            self.scheduler.add_request(Request(
                req_id=sample_id, prompt_token_ids=prompt, sampling_params=sample_params,
                arrival_time=arrival, eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt, lora_id=lora_id, parent_req_id=parent_id,
                index=index, tenant=tenant, tenant_weight=float(tenant_weight)))
        self.admitted_batches.add(batch_id)
        return [s[0] for s in samples]

    def validate_request(self, prompt_token_ids: Sequence[int],
                         sampling_params: SamplingParams | None = None,
                         cache_salt: str | None = None, lora_id: int = 0, *,
                         tenant: str | None = None,
                         tenant_weight: float = 1.0) -> SamplingParams:
        """Check a request without queuing it (ids aside); returns its parameters with
        ``max_tokens`` filled in. Raises InvalidRequestError naming the field."""
        prompt = list(prompt_token_ids)
        params = self._checked_fields(prompt, sampling_params, cache_salt, lora_id,
                                      tenant, tenant_weight)
        max_tokens = self.scheduler.check_request_fits(len(prompt), params.max_tokens)
        return params if params.max_tokens is not None else params.clone(max_tokens=max_tokens)

    def _checked_fields(self, prompt: list[int], sampling_params: SamplingParams | None,
                        cache_salt: str | None, lora_id: int, tenant: str | None,
                        tenant_weight: float) -> SamplingParams:
        if (asleep := self.control.refusal()) is not None:
            raise asleep
        params = sampling_params if sampling_params is not None else SamplingParams()
        params.validate()
        check_vocabulary(params.stop_token_ids, "stop_token_ids", self.vocab_size)
        if params.logit_bias:
            check_vocabulary(frozenset(params.logit_bias), "logit_bias", self.vocab_size)
        check_prompt(prompt, self.vocab_size)
        check_tenant(tenant, tenant_weight)
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 0:
            raise InvalidRequestError("lora_id must be a non-negative integer", "lora_id")
        if lora_id and self.lora is None:
            raise InvalidRequestError("LoRA adapters are off (lora.enable_lora)", "lora_id")
        if lora_id:
            self.lora.registry.registered_id(lora_id)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", "cache_salt")
        return params

    @staticmethod
    def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
        seed = None if params.seed is None else params.seed + index
        return params.clone(n=1, seed=seed)

    def _validate_ids(self, req_id: str, n: int) -> None:
        if not isinstance(req_id, str) or not 0 < len(req_id) <= MAX_REQ_ID_CHARS:
            raise InvalidRequestError(f"req_id must be a non-empty string of at most "
                                      f"{MAX_REQ_ID_CHARS} characters", "req_id")
        ids = [req_id] if n == 1 else [req_id] + [f"{i}_{req_id}" for i in range(n)]
        for candidate in ids:
            if self.scheduler.is_known_id(candidate):
                raise InvalidRequestError(f"request id {candidate!r} is in use", "req_id")

    def queue_rejection(self, num_prompt_tokens: int,
                        batch_id: str | None = None) -> str | None:
        """Backpressure for served requests (engine_core/queue_limits.py): why a new
        request must be refused now, or None. ``add_request`` does not ask.

        ``batch_id``: the multi-prompt request this prompt belongs to; once
        ``add_request`` has queued one of its prompts, the others are not refused (a
        request is admitted whole, as its n samples are)."""
        s = self.scheduler
        if batch_id in self.admitted_batches:
            return None
        return self.queue_limits.rejection(s.num_running, s.num_waiting,
                                           s.num_waiting_tokens, num_prompt_tokens)

    def is_queue_full(self) -> bool:
        """Whether even a one-token request would be refused now."""
        s = self.scheduler
        return self.queue_limits.is_full(s.num_running, s.num_waiting, s.num_waiting_tokens)

    def abort_request(self, req_ids: str | Iterable[str]) -> None:
        """Abort requests (a parent id aborts all its samples); see the class doc."""
        self.scheduler.finish_requests(req_ids)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one step, run it if there is anything to run, return the deltas."""
        scheduler_output = self.begin_step()
        is_busy = self.needs_worker(scheduler_output)
        if self.lora is not None and self.lora_executor is not None:
            # nothing to run but adapters loading: wait for one instead of spinning
            wait_s = 1.0 if not is_busy and self.lora.is_loading else 0.0
            self.apply_lora_effects(self.lora.exchange(self.lora_executor, wait_s))
        if is_busy:
            runner_output = self.executor.execute_model(scheduler_output)
        else:
            runner_output = ModelRunnerOutput()
        outputs = self.end_step(scheduler_output, runner_output)
        if self.lora is not None and self.lora_executor is not None:
            self.apply_lora_effects(self.lora.exchange(self.lora_executor))  # evictions of
        return outputs  # adapters whose last request just ended

    def apply_lora_effects(self, effects) -> list[str]:
        """End the requests whose adapter failed to load; their ids."""
        refused = [req_id for e in effects for req_id in e.refused_req_ids]
        if refused:
            self.scheduler.finish_requests(refused)
        return refused

    def begin_step(self) -> SchedulerOutput:
        """First half of ``step()``, for callers that run the model elsewhere (the
        engine-core service awaits a remote worker between the two halves)."""
        return self.scheduler.schedule()

    @staticmethod
    def needs_worker(scheduler_output: SchedulerOutput) -> bool:
        """Whether the plan has anything for the worker (tokens, drops or copies)."""
        return _has_work(scheduler_output)

    def end_step(self, scheduler_output: SchedulerOutput,
                 runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Second half of ``step()``: apply what the worker sampled; the deltas."""
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        """True while a request is live or an abort's final output is undelivered."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_outputs()

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes; False (nothing done) while any request holds blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def get_stats(self) -> EngineCoreStats:
        """Current gauges and cumulative counters."""
        kv = self.scheduler.kv_cache_manager
        spec = self.scheduler.speculator
        return EngineCoreStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_waiting_tokens=self.scheduler.num_waiting_tokens,
            num_preemptions=self.scheduler.num_preemptions, kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.num_query_tokens,
            prefix_cache_hits=kv.prefix_cache_stats.num_hit_tokens,
            lora=self.lora.stats(self.scheduler.running, list(self.scheduler.waiting))
            if self.lora is not None else None,
            spec_decode=copy.deepcopy(spec.stats) if spec is not None else None)

    def last_draft_outcomes(self) -> dict[str, DraftOutcome]:
        """Per request, the drafts verified in the step ``end_step`` last applied."""
        spec = self.scheduler.speculator
        return spec.last_outcomes if spec is not None else {}
