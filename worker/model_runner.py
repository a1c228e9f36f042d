"""The model runner: loads the model, owns the KV cache, executes scheduler steps."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from config.lora import LoRAConfig
from config.schema import MemoryConfig, ModelConfig, SchedulerConfig, WorkerConfig
from config.speculative import SpeculativeConfig
from engine_core.outputs import ModelRunnerOutput
from engine_core.scheduler_output import SchedulerOutput
from observability.logging import get_logger
from worker.attention_backend import (NATIVE_CPU, AttentionBackend, check_kv_cache_dtype,
                                     choose_attention_backend, make_attention_backend)
from worker.decode_v_pass import choose_decode_v_pass
from worker.deterministic import make_deterministic
from worker.device import resolve_device, resolve_dtype
from worker.distributed.step_channel import StepChannel
from worker.distributed.tp_group import TPGroup
from worker.draft_runner import DraftRunner
from worker.input_batch import InputBatch, build_input_batch
from worker.kv_cache import KVCacheSpec, copy_blocks, resolve_kv_cache_dtype
from worker.kv_pool import initialize_kv_pool
from worker.linear_backend import choose_linear_backends
from worker.huge_pages import move_to_huge_pages
from worker.loader import load_model
from worker.heap import StepTrim, release_freed_memory
from worker.quantization import load_weights, quantization_for_device
from worker.lora.lora_manager import LoRAManager
from worker.lora.lora_step import LoRAStep
from worker.models.registry import build_model
from worker.prompt_logprobs import compute_prompt_logprobs
from worker.request_state import CachedRequestState, make_generator
from worker.sampler import Sampler, row_argmax
from worker.sampling_metadata import SamplingMetadata, takes_argmax_only
from worker.speculative_sampler import SpeculativeSampler
from worker.step_timing import StepTiming
from worker.structured_output import StructuredOutputManager

log = get_logger(__name__)


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

    With ``tp`` (a tensor-parallel group) it holds this rank's slice of the model and KV
    cache. On rank 0 each step's inputs and logits requests are broadcast to the other
    ranks (worker/distributed/step_channel.py), which run the same forward in
    worker/distributed/follower.py; sampling happens here, on rank 0 only.
    """

    def __init__(self, model_config: ModelConfig, memory_config: MemoryConfig,
                 worker_config: WorkerConfig, scheduler_config: SchedulerConfig | None = None,
                 lora_config: LoRAConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None,
                 tp: TPGroup | None = None):
        self.model_config = model_config
        self.worker_config = worker_config
        self.memory_config = memory_config
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.last_timing = StepTiming()
        self.heap_trim = StepTrim()  # hands freed temporaries back (worker/heap.py)
        if worker_config.num_threads:
            torch.set_num_threads(worker_config.num_threads)
        self.tp = tp
        self.device = resolve_device(worker_config.device) if tp is None else tp.device
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        t0 = time.perf_counter()
        loaded = load_model(model_config.path, self.dtype,
                            quantization=quantization_for_device(model_config.quantization,
                                                                self.device, tp is not None))
        self.arch = loaded.architecture
        self.max_model_len = self._resolve_max_model_len()
        self.model = build_model(self.arch, self.max_model_len + 1, tp)
        self.quantization = load_weights(self.model, loaded, self.device, self.dtype)
        k_major_weights = (self.device.type == "cpu" and worker_config.k_major_weights
                           and self.model.prepare_for_cpu())
        if self.device.type == "cpu" and worker_config.huge_pages:
            move_to_huge_pages(self.model)  # before anything keeps pointers into them
        self.linear_table = (choose_linear_backends(self.model, worker_config.linear_backend)
                             if self.device.type == "cpu" else {})
        fused_decode = (self.device.type == "cpu" and worker_config.fused_decode
                        and self.model.enable_fused_decode())
        release_freed_memory()
        self.load_seconds = time.perf_counter() - t0
        log.debug("model loaded", path=str(loaded.source_path), dtype=str(self.dtype),
                  k_major_weights=k_major_weights, quantization=self.quantization,
                  fused_decode=fused_decode,
                  architecture=self.arch.architecture, seconds=round(self.load_seconds, 2))
        self.block_size = memory_config.block_size
        self.kv_cache_dtype = resolve_kv_cache_dtype(memory_config.kv_cache_dtype, self.dtype)
        self.channel = (StepChannel(tp, self.arch.hidden_size, self.dtype)
                        if tp is not None and tp.is_first else None)
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
            self.kv_cache_dtype) if spec.method == "draft_model" else None

    def _pick_attention_backend(self) -> AttentionBackend:
        from kernels import cpu_extension, cpu_paged_attention
        int8 = check_kv_cache_dtype(self.kv_cache_dtype, self.worker_config.attention_backend,
                                    self.device)
        name = choose_attention_backend(
            self.worker_config.attention_backend, self.device,
            lambda: not int8 and cpu_paged_attention.is_available())
        extra = {}
        if self.device.type == "cpu" and cpu_extension.load_seconds is not None:
            extra["build_or_load_seconds"] = round(cpu_extension.load_seconds, 2)
        log.debug("attention backend", backend=name, device=str(self.device),
                  deterministic=self.worker_config.deterministic, **extra)
        backend = make_attention_backend(name, self.device, self.model.shard.num_kv_heads)
        if self.worker_config.prefill_attention in ("native", "amx"):
            # the kernel's contract, settled once: bf16 activations and cache, head_dim
            # 64 or 128, no sliding window (whose prompts carry masks anyway)
            unmet = [why for why, ok in (
                ("the native CPU attention backend", name == NATIVE_CPU),
                ("bf16 activations and KV cache",
                 self.dtype == torch.bfloat16 and self.kv_cache_dtype == torch.bfloat16),
                ("head_dim 64 or 128", self.arch.head_dim in (64, 128)),
                ("no sliding window", self.arch.sliding_window is None),
                ("AVX512-BF16", name == NATIVE_CPU
                 and cpu_paged_attention.prefill_attention_available())) if not ok]
            if unmet:
                log.warning(f"worker.prefill_attention={self.worker_config.prefill_attention} "
                            "needs " + ", ".join(unmet) + ": prompts take sdpa")
            else:
                backend = replace(backend, native_prefill=True)
                log.debug("prefill attention", kernel="native",
                          on_tiles=cpu_paged_attention.prefill_attention_on_tiles())
        if self.worker_config.decode_v_pass != "widened":
            applies = name == NATIVE_CPU and self.dtype == self.kv_cache_dtype == torch.bfloat16
            backend = replace(backend, decode_v_pass=choose_decode_v_pass(
                self.worker_config.decode_v_pass, self.model.shard.num_heads,
                self.model.shard.num_kv_heads, self.arch.head_dim,
                self.worker_config.deterministic) if applies else "widened")
            if not applies:
                log.warning(f"worker.decode_v_pass={self.worker_config.decode_v_pass} needs "
                            "the native CPU attention backend, a bf16 model and a bf16 KV "
                            "cache: the decode kernel widens")
        if self.worker_config.deterministic:
            backend = make_deterministic(self.model, backend)
        return backend

    def kv_cache_spec(self) -> KVCacheSpec:
        """One block's layout on this rank (its KV heads only, under tensor parallelism)."""
        return KVCacheSpec.for_model(self.arch, self.block_size, self.kv_cache_dtype,
                                     self.model.shard.num_kv_heads)

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

    def initialize_kv_cache(self) -> int:
        """Allocate the KV pool from the memory budget; returns the number of blocks
        (worker/kv_pool.py: how the budget is found, and the CUDA graphs after it)."""
        return initialize_kv_pool(self)

    def wants_cuda_graphs(self) -> bool:
        return (self.device.type == "cuda" and not self.worker_config.enforce_eager
                and self.attention_backend.is_triton and self.tp is None)

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

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """Logits of these hidden rows (float32; ``keep_dtype``: the model's dtype, for
        a step that only takes argmaxes); under tensor parallelism the other ranks are
        asked for their vocabulary slices first (rank 0 only)."""
        if self.channel is not None:
            self.channel.send_logits(hidden)
        return self.model.compute_logits(hidden, keep_dtype=keep_dtype)

    def stop_followers(self) -> None:
        """Rank 0 under tensor parallelism: let the other ranks leave their loop."""
        if self.channel is not None:
            self.channel.send_stop()
            self.channel = None

    def synchronize(self) -> None:
        """Wait for the device, so a wall-clock split of the step is honest on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sample(self, states: list[CachedRequestState], logits: torch.Tensor,
               argmax_only: bool = False) -> tuple[list[int], list]:
        """One token per state from its row of ``logits``, sampled on the logits'
        device; only the ids and any requested logprobs cross to the host.
        ``argmax_only`` (from :meth:`_sampling_logits`): every row takes its argmax,
        with nothing to gather for the sampler (at batch 1 the gathering and the
        sampler's checks cost about 0.1 ms, 2% of a small model's step)."""
        if argmax_only:
            return row_argmax(logits).tolist(), [None] * len(states)
        md = SamplingMetadata.build(
            [s.sampling_params for s in states], [s.generator for s in states],
            [s.prompt_token_ids for s in states], [s.output_token_ids for s in states],
            self.eos_token_ids, logits.device)
        tokens, logprobs = self.sampler(logits, md)
        return tokens.tolist(), logprobs

    def _sampling_logits(self, batch: InputBatch, hidden: torch.Tensor,
                         grammar_step=None) -> tuple[torch.Tensor, bool]:
        """Logits of the rows that sample, and whether every row takes its plain argmax.
        Such a step samples argmaxes of the LM head's own output: the float32 copy of
        [rows, vocab] (about a millisecond at 48 rows) changes nothing."""
        sampling = batch.sampling_states
        argmax_only = (grammar_step is None and self.spec_sampler is None
                       and self.device.type == "cpu" and takes_argmax_only(
                           [s.sampling_params for s in sampling],
                           [s.output_token_ids for s in sampling]))
        return self.compute_logits(hidden[batch.logits_indices],
                                   keep_dtype=argmax_only), argmax_only

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput,
                      traceparent: str | None = None) -> ModelRunnerOutput:
        """Run one step; returns the tokens sampled for requests that reached their end.
        ``traceparent``: the engine's step span, for the other tensor-parallel ranks.

        ``last_timing`` then holds where the step's time went (wall clock; on CUDA the
        device is synchronised after the forward pass, so sampling is not billed for it).
        """
        try:
            return self._execute(so, traceparent)
        finally:
            if self.device.type == "cpu":
                self.heap_trim.after_step(
                    so.total_num_scheduled_tokens, len(so.scheduled_new_reqs),
                    so.num_decode_steps > 1
                    or so.total_num_scheduled_tokens == len(so.num_scheduled_tokens))

    def _execute(self, so: SchedulerOutput, traceparent: str | None) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        timing = self.last_timing = StepTiming()
        self._update_states(so)
        copies = [c.src for c in so.blocks_to_copy], [c.dst for c in so.blocks_to_copy]
        copy_blocks(self.kv_caches, *copies)
        if so.total_num_scheduled_tokens == 0:
            if self.channel is not None and copies[0]:
                self.channel.send_step(None, *copies, traceparent=traceparent)
            return ModelRunnerOutput()
        req_ids = list(so.num_scheduled_tokens)
        if so.num_decode_steps > 1:
            return self._execute_decode_steps(so, req_ids, copies, traceparent, t0)
        states = [self.requests[r] for r in req_ids]
        draft_probs = self._propose_drafts(so)
        batch = build_input_batch(states, [so.num_scheduled_tokens[r] for r in req_ids],
                                  self.block_size, self.arch.sliding_window,
                                  self.attention_backend)
        lora = (self.lora.prepare_step(batch.lora_ids, batch.request_start_loc)
                if self.lora is not None else None)
        # constrained rows' masks fill on a thread while the forward runs
        grammar_step = self.structured_output.begin_step(batch.sampling_states)
        if self.channel is not None:
            self.channel.send_step(batch.arrays, *copies, traceparent=traceparent)
        t1 = time.perf_counter()
        timing.prepare_seconds = t1 - t0
        hidden = self.forward(batch, lora)
        prompt_logprobs = (compute_prompt_logprobs(self, hidden, batch) if any(
            s.sampling_params.prompt_logprobs is not None for s in states) else {})
        for state, n in zip(states, (so.num_scheduled_tokens[r] for r in req_ids)):
            state.num_computed_tokens += n
        sampling = batch.sampling_states
        logits, argmax_only = (self._sampling_logits(batch, hidden, grammar_step)
                               if sampling else (None, False))
        self.synchronize()
        t2 = time.perf_counter()
        timing.forward_seconds = t2 - t1
        if not sampling:
            return ModelRunnerOutput(
                structured_output=self.structured_output.take_report(None),
                prompt_logprobs=prompt_logprobs)
        if self.spec_sampler is not None:  # constrained rows masked along their drafts
            sampling, tokens, logprobs = self.spec_sampler.verify(
                logits, sampling, draft_probs, grammar_step, self.draft_runner)
            timing.sample_seconds = time.perf_counter() - t2
            return ModelRunnerOutput(req_ids=[s.req_id for s in sampling],
                                     sampled_token_ids=tokens, logprobs=logprobs,
                                     structured_output=self.structured_output.take_report(
                                         grammar_step),
                                     prompt_logprobs=prompt_logprobs)
        if grammar_step is not None:  # masks applied; rows still compiling deferred
            logits, sampling = grammar_step.apply(logits, sampling)
        token_list, logprobs = self.sample(sampling, logits, argmax_only)
        for state, token in zip(sampling, token_list):
            state.token_ids.append(token)
        if grammar_step is not None:
            grammar_step.accept([[t] for t in token_list])
        timing.sample_seconds = time.perf_counter() - t2
        return ModelRunnerOutput(req_ids=[s.req_id for s in sampling],
                                 sampled_token_ids=[[t] for t in token_list],
                                 logprobs=[[lp] if lp is not None else None for lp in logprobs],
                                 structured_output=self.structured_output.take_report(
                                     grammar_step),
                                 prompt_logprobs=prompt_logprobs)

    def _execute_decode_steps(self, so: SchedulerOutput, req_ids: list[str],
                              copies: tuple[list[int], list[int]], traceparent: str | None,
                              started: float) -> ModelRunnerOutput:
        """A run of decode steps (``so.num_decode_steps`` > 1, engine_core/decode_steps.py):
        request r computes its last token and samples ``num_scheduled_tokens[r]`` times,
        each token the next step's input; its tokens and logprobs come back together."""
        timing = self.last_timing
        remaining = {r: so.num_scheduled_tokens[r] for r in req_ids}
        tokens: dict[str, list[int]] = {r: [] for r in req_ids}
        logprobs: dict[str, list] = {r: [] for r in req_ids}
        t0 = started
        for _ in range(so.num_decode_steps):
            states = [self.requests[r] for r in req_ids if remaining[r] > 0]
            batch = build_input_batch(states, [1] * len(states), self.block_size,
                                      self.arch.sliding_window, self.attention_backend)
            lora = (self.lora.prepare_step(batch.lora_ids, batch.request_start_loc)
                    if self.lora is not None else None)
            if self.channel is not None:  # the block copies go with the first step
                self.channel.send_step(batch.arrays, *copies, traceparent=traceparent)
                copies = [], []
            t1 = time.perf_counter()
            timing.prepare_seconds += t1 - t0
            hidden = self.forward(batch, lora)
            for state in states:
                state.num_computed_tokens += 1
                remaining[state.req_id] -= 1
            logits, argmax_only = self._sampling_logits(batch, hidden)
            self.synchronize()
            t2 = time.perf_counter()
            timing.forward_seconds += t2 - t1
            sampled, sampled_logprobs = self.sample(batch.sampling_states, logits,
                                                    argmax_only)
            for state, token, lp in zip(batch.sampling_states, sampled, sampled_logprobs):
                state.token_ids.append(token)
                tokens[state.req_id].append(token)
                logprobs[state.req_id].append(lp)
            t0 = time.perf_counter()
            timing.sample_seconds += t0 - t2
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[tokens[r] for r in req_ids],
            logprobs=[None if None in logprobs[r] else logprobs[r] for r in req_ids],
            structured_output=self.structured_output.take_report(None))
