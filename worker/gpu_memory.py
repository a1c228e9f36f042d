"""Size the KV pool on a GPU: measure one forward pass at the largest step, give the
cache whatever ``memory.gpu_memory_utilization`` leaves.

::

    total * utilization
      = peak torch allocation of the profiling step (weights + activations + logits)
      + memory outside torch's allocator (CUDA context, cuBLAS workspaces, other
        processes on the same GPU)
      + CUDA graphs (when they will be captured: measured by capturing them once on a
        two-block scratch cache, then freed; the real capture is measured again)
      + KV cache  <- what is left

The profiling step schedules ``max_num_batched_tokens`` prompt tokens, split into
sequences no longer than ``max_model_len`` and no more than ``max_num_seqs``, on a
scratch cache just big enough for them (its bytes are taken out of the peak), and
computes logits for up to ``max_num_seqs`` of them, as a real step would.
"""
from __future__ import annotations

import torch

from engine_core.worker_sampling import WorkerSamplingParams
from observability.logging import get_logger
from worker.kv_cache import allocate_kv_cache
from worker.request_state import CachedRequestState

log = get_logger(__name__)


def kv_cache_budget(total_bytes: int, utilization: float, peak_torch_bytes: int,
                    non_torch_bytes: int, graph_bytes: int = 0) -> int:
    """Bytes the KV cache may take (0 when the model alone exceeds the budget)."""
    return max(0, int(total_bytes * utilization) - peak_torch_bytes - non_torch_bytes
               - graph_bytes)


def profile_prompt_lengths(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Split the step's token budget into at most ``max_num_seqs`` prompts of at most
    ``max_model_len`` tokens (fewer tokens when both limits bind)."""
    num_tokens = min(num_tokens, max_model_len * max_num_seqs)
    num_seqs = min(max_num_seqs, max(1, -(-num_tokens // max_model_len)))
    base, extra = divmod(num_tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs) if base + (i < extra) > 0]


def _dummy_states(lengths: list[int], block_size: int) -> list[CachedRequestState]:
    states, next_block = [], 1  # block 0 stays the null block
    for i, n in enumerate(lengths):
        num_blocks = -(-n // block_size)
        states.append(CachedRequestState(
            req_id=f"profile-{i}", token_ids=[0] * n, num_prompt_tokens=n,
            sampling_params=WorkerSamplingParams(), num_computed_tokens=0, generator=None,
            block_ids=list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    return states


@torch.inference_mode()
def run_profile_step(runner, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The largest step on a scratch cache (any device); returns the scratch bytes."""
    from worker.input_batch import build_input_batch
    lengths = profile_prompt_lengths(max_num_batched_tokens, runner.max_model_len,
                                     max_num_seqs)
    states = _dummy_states(lengths, runner.block_size)
    spec = runner.kv_cache_spec()
    scratch_blocks = 1 + sum(len(s.block_ids) for s in states)
    scratch = allocate_kv_cache(spec, scratch_blocks, runner.device)
    batch = build_input_batch(states, lengths, runner.block_size, runner.arch.sliding_window,
                              runner.attention_backend)
    hidden = runner.model(batch.input_ids, batch.positions, scratch, batch.attn)
    rows = hidden[-1:].expand(min(max_num_seqs, 4096), -1)  # logits as a full step has
    runner.model.compute_logits(rows)
    log.info("profiling step", tokens=sum(lengths), seqs=len(lengths))
    return scratch_blocks * spec.bytes_per_block


def profile_graph_bytes(runner) -> int:
    """Capture the runner's decode graphs on a two-block scratch cache (their padding
    rows read and write no block), free them; the memory they held."""
    from worker.cuda_graphs import DecodeCudaGraphs
    spec = runner.kv_cache_spec()
    graphs = DecodeCudaGraphs.for_runner(runner, allocate_kv_cache(spec, 2, runner.device))
    graph_bytes = graphs.capture()
    del graphs
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    return graph_bytes


def profile_kv_cache_bytes(runner, max_num_batched_tokens: int, max_num_seqs: int,
                           utilization: float, with_graphs: bool = False
                           ) -> tuple[int, int]:
    """Run the profiling step on ``runner`` (a CUDA ModelRunner), and a profiled graph
    capture when ``with_graphs``; the KV budget and the graph reserve, in bytes."""
    device = runner.device
    assert device.type == "cuda", "memory profiling is for CUDA devices"
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch_bytes = run_profile_step(runner, max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    torch.cuda.empty_cache()  # the step's activations and scratch cache go back
    graph_bytes = profile_graph_bytes(runner) if with_graphs else 0
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = kv_cache_budget(total, utilization, peak, non_torch, graph_bytes)
    log.info("gpu memory profiled", total_gib=round(total / 2 ** 30, 2),
             utilization=utilization, peak_torch_gib=round(peak / 2 ** 30, 3),
             non_torch_gib=round(non_torch / 2 ** 30, 3),
             cuda_graph_reserve_gib=round(graph_bytes / 2 ** 30, 3),
             kv_cache_gib=round(budget / 2 ** 30, 3))
    return budget, graph_bytes
