"""The model runner: loads the model, owns the KV cache, executes scheduler steps."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from config.schema import MemoryConfig, ModelConfig, WorkerConfig
from engine_core.outputs import ModelRunnerOutput
from engine_core.scheduler_output import SchedulerOutput
from observability.logging import get_logger
from worker.device import resolve_device, resolve_dtype
from worker.input_batch import build_input_batch
from worker.kv_cache import KVCacheSpec, allocate_kv_cache, copy_blocks
from worker.loader import load_model
from worker.models.linear import pack_linear_layers
from worker.models.registry import build_model
from worker.request_state import CachedRequestState, make_generator
from worker.sampler import Sampler
from worker.sampling_metadata import SamplingMetadata

log = get_logger(__name__)


@dataclass(slots=True)
class StepTiming:
    """Where one step's time went: building the batch, the forward pass, sampling."""

    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0


class ModelRunner:
    """Keeps per-request state across steps and runs one flat batch per step.

    Life cycle: ``ModelRunner(...)`` loads weights; ``initialize_kv_cache()`` sizes and
    allocates the pool and returns its number of blocks; ``execute_model()`` runs steps.
    """

    def __init__(self, model_config: ModelConfig, memory_config: MemoryConfig,
                 worker_config: WorkerConfig):
        self.model_config = model_config
        self.worker_config = worker_config
        self.memory_config = memory_config
        self.last_timing = StepTiming()
        if worker_config.num_threads:
            torch.set_num_threads(worker_config.num_threads)
        self.device = resolve_device(worker_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        t0 = time.perf_counter()
        loaded = load_model(model_config.path, self.dtype)
        self.arch = loaded.architecture
        self.max_model_len = self._resolve_max_model_len()
        self.model = build_model(self.arch, self.max_model_len + 1)
        self.model.load_weights(loaded.state_dict)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.num_packed_layers = (pack_linear_layers(self.model)
                                  if worker_config.pack_weights else 0)
        self.load_seconds = time.perf_counter() - t0
        log.info("model loaded", path=str(loaded.source_path), dtype=str(self.dtype),
                 packed_linear_layers=self.num_packed_layers,
                 architecture=self.arch.architecture, seconds=round(self.load_seconds, 2))
        self.block_size = memory_config.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.eos_token_ids = tuple(self.arch.eos_token_ids)
        self.use_native_decode = self._pick_attention_backend()

    def _pick_attention_backend(self) -> bool:
        if self.worker_config.attention_backend == "torch" or self.device.type != "cpu":
            return False
        from kernels import cpu_paged_attention
        native = cpu_paged_attention.is_available()
        log.info("attention backend", decode="native-cpu" if native else "torch",
                 build_or_load_seconds=round(cpu_paged_attention.load_seconds or 0.0, 2))
        return native

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
        """Allocate the KV pool from the memory budget; returns the number of blocks."""
        spec = KVCacheSpec.for_model(self.arch, self.block_size, self.dtype)
        num_blocks = self.memory_config.num_blocks or spec.num_blocks_for(
            self.memory_config.kv_cache_bytes)
        needed = -(-self.max_model_len // self.block_size) + 1
        if num_blocks < needed:
            raise ValueError(
                f"KV cache too small: {num_blocks} blocks of {self.block_size} tokens cannot "
                f"hold one sequence of max_model_len={self.max_model_len} ({needed} blocks "
                f"needed, {spec.bytes_per_block} bytes each); raise memory.kv_cache_bytes or "
                f"lower model.max_model_len")
        self.kv_caches = allocate_kv_cache(spec, num_blocks, self.device)
        log.info("kv cache allocated", num_blocks=num_blocks,
                 num_tokens=num_blocks * self.block_size,
                 bytes=num_blocks * spec.bytes_per_block)
        return num_blocks

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            p = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens, sampling_params=p,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=make_generator(p.seed, new.num_output_tokens, self.arch.vocab_size))
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the tokens sampled for requests that reached their end.

        ``last_timing`` then holds where the step's time went (CPU wall clock)."""
        t0 = time.perf_counter()
        timing = self.last_timing = StepTiming()
        self._update_states(so)
        copy_blocks(self.kv_caches, [c.src for c in so.blocks_to_copy],
                    [c.dst for c in so.blocks_to_copy])
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        batch = build_input_batch(states, [so.num_scheduled_tokens[r] for r in req_ids],
                                  self.block_size, self.arch.sliding_window,
                                  self.use_native_decode)
        t1 = time.perf_counter()
        timing.prepare_seconds = t1 - t0
        hidden = self.model(batch.input_ids.to(self.device), batch.positions.to(self.device),
                            self.kv_caches, batch.attn)
        for state, n in zip(states, (so.num_scheduled_tokens[r] for r in req_ids)):
            state.num_computed_tokens += n
        if not batch.sampling_states:
            timing.forward_seconds = time.perf_counter() - t1
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        t2 = time.perf_counter()
        timing.forward_seconds = t2 - t1
        sampling = batch.sampling_states
        md = SamplingMetadata.build(
            [s.sampling_params for s in sampling], [s.generator for s in sampling],
            [s.prompt_token_ids for s in sampling] , [s.output_token_ids for s in sampling],
            self.eos_token_ids)
        tokens, logprobs = self.sampler(logits.cpu(), md)
        token_list = tokens.tolist()
        for state, token in zip(sampling, token_list):
            state.token_ids.append(token)
        timing.sample_seconds = time.perf_counter() - t2
        return ModelRunnerOutput(req_ids=[s.req_id for s in sampling],
                                 sampled_token_ids=[[t] for t in token_list],
                                 logprobs=[[lp] if lp is not None else None for lp in logprobs])
