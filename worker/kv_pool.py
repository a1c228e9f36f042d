"""Sizing and allocating a runner's KV pool (and, on CUDA, capturing its decode graphs).

CPU: memory.kv_cache_bytes. CUDA: what a profiling step at the largest batch and a
profiled graph capture leave of memory.gpu_memory_utilization (worker/gpu_memory.py).
memory.num_blocks, when set, overrides either budget. Under tensor parallelism every
rank sizes its own pool (its KV heads only) and all of them use the smallest.
"""
from __future__ import annotations

from observability.logging import get_logger
from worker.kv_cache import allocate_kv_cache

log = get_logger(__name__)


def kv_cache_budget(runner) -> tuple[int, str]:
    """Bytes for the KV pool and the key that sets them (for error messages)."""
    if runner.device.type != "cuda":
        return runner.memory_config.kv_cache_bytes, "memory.kv_cache_bytes"
    from worker.gpu_memory import profile_kv_cache_bytes
    sched = runner.scheduler_config
    budget, runner.graph_reserve_bytes = profile_kv_cache_bytes(
        runner, sched.max_num_batched_tokens, sched.max_num_seqs,
        runner.memory_config.gpu_memory_utilization, with_graphs=runner.wants_cuda_graphs())
    return budget, "memory.gpu_memory_utilization"


def initialize_kv_pool(runner) -> int:
    """Allocate ``runner.kv_caches`` (and the draft model's); returns the number of
    blocks. Then the decode CUDA graphs are captured unless worker.enforce_eager."""
    spec = runner.kv_cache_spec()
    num_blocks, key = runner.memory_config.num_blocks, "memory.num_blocks"
    if not num_blocks:
        budget, key = kv_cache_budget(runner)
        draft = runner.draft_runner.kv_spec.bytes_per_block if runner.draft_runner else 0
        num_blocks = budget // (spec.bytes_per_block + draft)
    if runner.tp is not None:  # every rank sized its own pool: all use the smallest
        num_blocks = runner.tp.min_int(num_blocks)
    needed = -(-runner.max_model_len // runner.block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks of {runner.block_size} tokens cannot "
            f"hold one sequence of max_model_len={runner.max_model_len} ({needed} blocks "
            f"needed, {spec.bytes_per_block} bytes each); raise {key} or lower "
            f"model.max_model_len")
    runner.kv_caches = allocate_kv_cache(spec, num_blocks, runner.device)
    if runner.draft_runner is not None:
        runner.draft_runner.allocate_kv_cache(num_blocks)
    log.debug("kv cache allocated", num_blocks=num_blocks,
              num_tokens=num_blocks * runner.block_size,
              bytes=num_blocks * spec.bytes_per_block, sized_by=key)
    maybe_capture_cuda_graphs(runner)
    return num_blocks


def maybe_capture_cuda_graphs(runner) -> None:
    if not runner.wants_cuda_graphs():
        return
    from worker.cuda_graphs import DecodeCudaGraphs
    runner.cuda_graphs = graphs = DecodeCudaGraphs.for_runner(runner, runner.kv_caches)
    used = graphs.capture()
    reserved = runner.graph_reserve_bytes
    log.info("cuda graph memory", used_mib=round(used / 2 ** 20, 1),
             reserved_in_budget_mib=round(reserved / 2 ** 20, 1))
    if reserved and used > reserved:
        log.warning("cuda graphs took more memory than the KV budget reserved",
                    used_mib=round(used / 2 ** 20, 1), reserved_mib=round(reserved / 2 ** 20, 1))
