"""The model runner: loads the model, owns the KV cache, executes scheduler steps."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from config.lora import LoRAConfig
from config.schema import MemoryConfig, ModelConfig, SchedulerConfig, WorkerConfig
from config.speculative import SpeculativeConfig
from engine_core.outputs import ModelRunnerOutput
from engine_core.scheduler_output import SchedulerOutput
from observability.logging import get_logger
from worker.attention_backend import (NATIVE_CPU, AttentionBackend, choose_attention_backend,
                                     make_attention_backend)
from worker.device import resolve_device, resolve_dtype
from worker.draft_runner import DraftRunner, draft_probs_rows
from worker.input_batch import InputBatch, build_input_batch
from worker.kv_cache import KVCacheSpec, allocate_kv_cache, copy_blocks
from worker.linear_backend import choose_linear_backends
from worker.loader import load_model
from worker.quantization import load_weights, quantization_for_device, release_freed_memory
from worker.lora.lora_manager import LoRAManager
from worker.lora.lora_step import LoRAStep
from worker.models.registry import build_model
from worker.prompt_logprobs import compute_prompt_logprobs
from worker.request_state import CachedRequestState, make_generator
from worker.sampler import Sampler
from worker.sampling_metadata import SamplingMetadata
from worker.speculative_sampler import SpeculativeSampler
from worker.structured_output import StructuredOutputManager

log = get_logger(__name__)


@dataclass(slots=True)
class StepTiming:
    """Where one step's time went: building the batch, the forward pass, sampling;
    ``draft_seconds``: the draft model proposing (speculative decoding)."""

    prepare_seconds: float = 0.0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0


class ModelRunner:
    """Keeps per-request state across steps and runs one flat batch per step.

    Life cycle: ``ModelRunner(...)`` loads weights; ``initialize_kv_cache()`` sizes and
    allocates the pool (on CUDA from a profiling step, then captures the decode CUDA
    graphs) and returns its number of blocks; ``execute_model()`` runs steps.
    ``scheduler_config`` gives the largest step (profiling, graph sizes); its defaults
    are used when it is None. With ``lora_config.enable_lora``, ``lora`` holds the
    adapters (worker/lora/lora_manager.py). With ``speculative_config`` on, steps verify
    drafts (worker/speculative_sampler.py) and, for draft_model, a DraftRunner proposes
    them.
    """

    def __init__(self, model_config: ModelConfig, memory_config: MemoryConfig,
                 worker_config: WorkerConfig, scheduler_config: SchedulerConfig | None = None,
                 lora_config: LoRAConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None):
        self.model_config = model_config
        self.worker_config = worker_config
        self.memory_config = memory_config
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.last_timing = StepTiming()
        if worker_config.num_threads:
            torch.set_num_threads(worker_config.num_threads)
        self.device = resolve_device(worker_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        t0 = time.perf_counter()
        loaded = load_model(model_config.path, self.dtype,
                            quantization=quantization_for_device(model_config.quantization,
                                                                self.device))
        self.arch = loaded.architecture
        self.max_model_len = self._resolve_max_model_len()
        self.model = build_model(self.arch, self.max_model_len + 1)
        self.quantization = load_weights(self.model, loaded, self.device, self.dtype)
        k_major_weights = (self.device.type == "cpu" and worker_config.k_major_weights
                           and self.model.prepare_for_cpu())
        self.linear_table = (choose_linear_backends(self.model, worker_config.linear_backend)
                             if self.device.type == "cpu" else {})
        release_freed_memory()
        self.load_seconds = time.perf_counter() - t0
        log.debug("model loaded", path=str(loaded.source_path), dtype=str(self.dtype),
                  k_major_weights=k_major_weights, quantization=self.quantization,
                  architecture=self.arch.architecture, seconds=round(self.load_seconds, 2))
        self.block_size = memory_config.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.eos_token_ids = tuple(self.arch.eos_token_ids)
        self.structured_output = StructuredOutputManager(self.arch.vocab_size,
                                                         self.eos_token_ids)
        self.attention_backend = self._pick_attention_backend()
        self.cuda_graphs = None  # DecodeCudaGraphs once captured
        self.graph_reserve_bytes = 0  # what the KV budget left for them (profiled)
        self.lora = (LoRAManager(lora_config, self.arch, self.dtype, self.device)
                     if lora_config is not None and lora_config.enable_lora else None)
        spec = self.spec_config = speculative_config or SpeculativeConfig()
        self.spec_sampler = SpeculativeSampler(self.eos_token_ids) if spec.is_enabled else None
        self.draft_runner = DraftRunner(
            spec.draft_model, self.arch, self.dtype, self.device, self.attention_backend.name,
            self.block_size, self.max_model_len, worker_config.k_major_weights,
        ) if spec.method == "draft_model" else None

    def _pick_attention_backend(self) -> AttentionBackend:
        from kernels import cpu_extension, cpu_paged_attention
        name = choose_attention_backend(self.worker_config.attention_backend, self.device,
                                        cpu_paged_attention.is_available)
        extra = {}
        if self.device.type == "cpu" and cpu_extension.load_seconds is not None:
            extra["build_or_load_seconds"] = round(cpu_extension.load_seconds, 2)
        log.debug("attention backend", backend=name, device=str(self.device), **extra)
        return make_attention_backend(name, self.device, self.arch.num_key_value_heads)

    @property
    def use_native_decode(self) -> bool:
        return self.attention_backend.name == NATIVE_CPU

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        wanted = self.model_config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(f"model.max_model_len={wanted} exceeds the model's limit of "
                             f"{limit} positions")
        return wanted

    def _kv_cache_budget(self) -> tuple[int, str]:
        """Bytes for the KV pool and the key that sets them (for error messages)."""
        if self.device.type != "cuda":
            return self.memory_config.kv_cache_bytes, "memory.kv_cache_bytes"
        from worker.gpu_memory import profile_kv_cache_bytes
        sched = self.scheduler_config
        budget, self.graph_reserve_bytes = profile_kv_cache_bytes(
            self, sched.max_num_batched_tokens, sched.max_num_seqs,
            self.memory_config.gpu_memory_utilization, with_graphs=self._wants_cuda_graphs())
        return budget, "memory.gpu_memory_utilization"

    def initialize_kv_cache(self) -> int:
        """Allocate the KV pool from the memory budget; returns the number of blocks.

        CPU: memory.kv_cache_bytes. CUDA: what a profiling step at the largest batch and
        a profiled graph capture leave of memory.gpu_memory_utilization
        (worker/gpu_memory.py); then the decode CUDA graphs are captured unless
        worker.enforce_eager. memory.num_blocks, when set, overrides either budget.
        """
        spec = KVCacheSpec.for_model(self.arch, self.block_size, self.dtype)
        num_blocks, key = self.memory_config.num_blocks, "memory.num_blocks"
        if not num_blocks:
            budget, key = self._kv_cache_budget()
            draft = self.draft_runner.kv_spec.bytes_per_block if self.draft_runner else 0
            num_blocks = budget // (spec.bytes_per_block + draft)
        needed = -(-self.max_model_len // self.block_size) + 1
        if num_blocks < needed:
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks of {self.block_size} tokens cannot "
                f"hold one sequence of max_model_len={self.max_model_len} ({needed} blocks "
                f"needed, {spec.bytes_per_block} bytes each); raise {key} or lower "
                f"model.max_model_len")
        self.kv_caches = allocate_kv_cache(spec, num_blocks, self.device)
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(num_blocks)
        log.debug("kv cache allocated", num_blocks=num_blocks,
                  num_tokens=num_blocks * self.block_size,
                  bytes=num_blocks * spec.bytes_per_block, sized_by=key)
        self._maybe_capture_cuda_graphs()
        return num_blocks

    def _wants_cuda_graphs(self) -> bool:
        return (self.device.type == "cuda" and not self.worker_config.enforce_eager
                and self.attention_backend.is_triton)

    def _maybe_capture_cuda_graphs(self) -> None:
        if not self._wants_cuda_graphs():
            return
        from worker.cuda_graphs import DecodeCudaGraphs
        self.cuda_graphs = DecodeCudaGraphs.for_runner(self, self.kv_caches)
        used = self.cuda_graphs.capture()
        log.info("cuda graph memory", used_mib=round(used / 2 ** 20, 1),
                 reserved_in_budget_mib=round(self.graph_reserve_bytes / 2 ** 20, 1))
        if self.graph_reserve_bytes and used > self.graph_reserve_bytes:
            log.warning("cuda graphs took more memory than the KV budget reserved",
                        used_mib=round(used / 2 ** 20, 1),
                        reserved_mib=round(self.graph_reserve_bytes / 2 ** 20, 1))

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            p = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens, sampling_params=p,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=make_generator(p.seed, new.num_output_tokens, self.arch.vocab_size,
                                         self.device),
                lora_id=new.lora_id)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.num_dropped_blocks:  # they held only rejected drafts
                del state.block_ids[-cached.num_dropped_blocks:]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, draft_ids in so.spec_token_ids.items():
            self.requests[req_id].spec_token_ids = list(draft_ids)

    def _propose_drafts(self, so: SchedulerOutput) -> dict[str, torch.Tensor]:
        """The draft model's drafts for requests the engine core left them to; their
        draft distributions when sampled (worker/draft_runner.py)."""
        wanted = [r for r in so.num_spec_tokens if r not in so.spec_token_ids]
        if not wanted or self.draft_runner is None:
            return {}
        t0 = time.perf_counter()
        probs = self.draft_runner.propose([self.requests[r] for r in wanted],
                                          [so.num_spec_tokens[r] for r in wanted])
        self.last_timing.draft_seconds = time.perf_counter() - t0
        return probs

    def forward(self, batch: InputBatch, lora: LoRAStep | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of one built batch: a captured CUDA graph when
        one fits (decode-only batches without adapters), else the eager model."""
        if lora is None and self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, lora)

    def synchronize(self) -> None:
        """Wait for the device, so a wall-clock split of the step is honest on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sample(self, states: list[CachedRequestState], logits: torch.Tensor
               ) -> tuple[list[int], list]:
        """One token per state from its row of ``logits``, sampled on the logits'
        device; only the ids and any requested logprobs cross to the host."""
        md = SamplingMetadata.build(
            [s.sampling_params for s in states], [s.generator for s in states],
            [s.prompt_token_ids for s in states], [s.output_token_ids for s in states],
            self.eos_token_ids, logits.device)
        tokens, logprobs = self.sampler(logits, md)
        return tokens.tolist(), logprobs

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the tokens sampled for requests that reached their end.

        ``last_timing`` then holds where the step's time went (wall clock; on CUDA the
        device is synchronised after the forward pass, so sampling is not billed for it).
        """
        t0 = time.perf_counter()
        timing = self.last_timing = StepTiming()
        self._update_states(so)
        copy_blocks(self.kv_caches, [c.src for c in so.blocks_to_copy],
                    [c.dst for c in so.blocks_to_copy])
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        draft_probs = self._propose_drafts(so)
        batch = build_input_batch(states, [so.num_scheduled_tokens[r] for r in req_ids],
                                  self.block_size, self.arch.sliding_window,
                                  self.attention_backend)
        lora = (self.lora.prepare_step(batch.lora_ids, batch.request_start_loc)
                if self.lora is not None else None)
        # constrained rows' masks fill on a thread while the forward runs
        grammar_step = self.structured_output.begin_step(batch.sampling_states)
        t1 = time.perf_counter()
        timing.prepare_seconds = t1 - t0
        hidden = self.forward(batch, lora)
        prompt_logprobs = (compute_prompt_logprobs(self.model, hidden, batch) if any(
            s.sampling_params.prompt_logprobs is not None for s in states) else {})
        for state, n in zip(states, (so.num_scheduled_tokens[r] for r in req_ids)):
            state.num_computed_tokens += n
        sampling = batch.sampling_states
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if sampling else None
        self.synchronize()
        t2 = time.perf_counter()
        timing.forward_seconds = t2 - t1
        if not sampling:
            return ModelRunnerOutput(
                structured_output=self.structured_output.take_report(None),
                prompt_logprobs=prompt_logprobs)
        if self.spec_sampler is not None:  # never with a grammar: the engine core refuses
            output = self._sample_speculative(logits, sampling, draft_probs)  # those
            output.prompt_logprobs = prompt_logprobs
            timing.sample_seconds = time.perf_counter() - t2
            return output
        if grammar_step is not None:  # masks applied; rows still compiling deferred
            logits, sampling = grammar_step.apply(logits, sampling)
        token_list, logprobs = self.sample(sampling, logits)
        for state, token in zip(sampling, token_list):
            state.token_ids.append(token)
        if grammar_step is not None:
            grammar_step.accept(token_list)
        timing.sample_seconds = time.perf_counter() - t2
        return ModelRunnerOutput(req_ids=[s.req_id for s in sampling],
                                 sampled_token_ids=[[t] for t in token_list],
                                 logprobs=[[lp] if lp is not None else None for lp in logprobs],
                                 structured_output=self.structured_output.take_report(
                                     grammar_step),
                                 prompt_logprobs=prompt_logprobs)

    def _sample_speculative(self, logits: torch.Tensor, states: list[CachedRequestState],
                            draft_probs: dict[str, torch.Tensor]) -> ModelRunnerOutput:
        """Verify drafts (k+1 logits rows per request with k); each state's progress
        steps back over its rejected drafts, as the engine core's does."""
        num_drafts = [len(s.spec_token_ids) for s in states]
        rows = draft_probs_rows(states, num_drafts, draft_probs, logits.shape[-1])
        tokens, logprobs = self.spec_sampler(logits, states, rows)
        for state, k, emitted in zip(states, num_drafts, tokens):
            state.num_computed_tokens -= k + 1 - len(emitted)
            if self.draft_runner is not None:
                self.draft_runner.on_verified(state, k, len(emitted))
        return ModelRunnerOutput(req_ids=[s.req_id for s in states],
                                 sampled_token_ids=tokens, logprobs=logprobs)
