"""CUDA graphs for decode steps: one captured forward pass per batch size on a ladder.

A decode step of a small model is mostly kernel-launch overhead (30 layers x ~10
kernels). A CUDA graph replays the whole forward pass with one launch, but it replays
fixed pointers and fixed grids, so:

- every input lives in a static buffer; a step copies its batch into the first ``n``
  rows and pads up to the next captured size ``B``::

      rows     0 .. n-1          n .. B-1 (padding)
      slot     real slots        -1   (reshape_and_cache writes nothing)
      seq_len  real lengths      0    (attention reads nothing, outputs zeros)
      token    real ids/positions  left over from earlier steps (valid values, unused)

- the attention metadata is decode-only (query_start_loc = 0, 1, ..., B), and split-KV
  is fixed per size at capture time for the longest context (max_model_len); the
  kernel sizes each split from the real seq_lens, so any length stays correct.

Only the Triton backend on CUDA is captured; batches with prefill chunks, or larger
than the largest size, run eagerly. ``worker.enforce_eager: true`` turns graphs off.

Memory: the graphs' private pool (activations of the largest size, reused by the
smaller ones, plus every size's output) lives as long as the graphs. The KV pool is
sized after a profiled capture on a scratch cache (worker/gpu_memory.py), so that
memory is inside ``gpu_memory_utilization``; ``capture()`` measures it each time.
"""
from __future__ import annotations

import time

import torch

from kernels.paged_attention import PagedAttentionPlan, RaggedAttentionMetadata
from kernels.split_kv import choose_num_splits
from observability.logging import get_logger
from worker.attention_backend import AttentionBackend
from worker.input_batch import InputBatch
from worker.models.llama import AttentionContext

log = get_logger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The ladder: 1, 2, 4, 8, then every multiple of 16, up to min(max_num_seqs, limit),
    which is always on it. Padding to the next rung wastes under 16 rows past 8."""
    top = max(1, min(max_num_seqs, limit))
    sizes = {s for s in (1, 2, 4, 8) if s < top} | set(range(16, top, 16)) | {top}
    return sorted(sizes)


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` rows; None if none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


class DecodeCudaGraphs:
    """Captured decode forward passes over static input buffers (CUDA only)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 sizes: list[int], max_blocks_per_seq: int, backend: AttentionBackend,
                 sliding_window: int | None, max_model_len: int):
        assert backend.is_triton, "graphs capture the Triton backend's fixed-grid kernels"
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.backend, self.sliding_window = backend, sliding_window
        self.max_model_len = max_model_len
        n, dev = sizes[-1], backend.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0  # what capture() kept reserved (graph pool + outputs)

    @classmethod
    def for_runner(cls, runner, kv_caches: list[torch.Tensor]) -> "DecodeCudaGraphs":
        """Graphs for every size up to the runner's max_num_seqs over ``kv_caches``."""
        max_blocks = -(-runner.max_model_len // runner.block_size) + 1
        return cls(runner.model, kv_caches, capture_sizes(runner.scheduler_config.max_num_seqs),
                   max_blocks, runner.attention_backend, runner.arch.sliding_window,
                   runner.max_model_len)

    def _context(self, size: int) -> AttentionContext:
        num_splits = 1
        if self.backend.num_sms is not None:
            num_splits = choose_num_splits(size, self.backend.num_kv_heads, 1,
                                           self.max_model_len, self.backend.num_sms)
        meta = RaggedAttentionMetadata(self.query_start_loc[:size + 1], self.seq_lens[:size],
                                       self.block_tables[:size], max_query_len=1,
                                       num_splits=num_splits)
        plan = PagedAttentionPlan(size, None, None, [], sliding_window=self.sliding_window,
                                  ragged=meta)
        return AttentionContext(slot_mapping=self.slot_mapping[:size], plan=plan)

    def forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                          self._context(size))

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every size, largest first, all sharing one memory pool. The buffers
        hold padding only (slots -1, lengths 0), so capturing touches no KV block.

        Returns (and keeps in ``memory_bytes``) the memory the graphs hold on to: the
        allocator's reserve after capture minus before, both taken with its cache
        emptied (the warm-ups' activations are transient and go back)."""
        assert self.backend.device.type == "cuda", "CUDA graphs need a CUDA device"
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        # one side stream for every warm-up (Triton compiles, cuBLAS picks its kernels,
        # as torch.cuda.graph requires): cuBLAS keeps a workspace per stream
        side = torch.cuda.Stream()
        for size in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.memory_bytes = torch.cuda.memory_reserved() - reserved_before
        log.info("cuda graphs captured", sizes=len(self.sizes), largest=self.sizes[-1],
                 memory_mib=round(self.memory_bytes / 2 ** 20, 1),
                 seconds=round(time.perf_counter() - t0, 2))
        return self.memory_bytes

    def can_run(self, batch: InputBatch) -> bool:
        """A decode-only Triton batch that fits a captured size and the table width."""
        meta = batch.attn.plan.ragged
        return (meta is not None and batch.is_decode_only
                and len(batch.seq_lens) <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, batch: InputBatch) -> torch.Tensor:
        """Copy the batch into the buffers, pad, replay; hidden states ``[n, hidden]``.

        The returned tensor is the graph's output buffer: read it before the next step.
        """
        size = self.fill(batch)
        self.graphs[size].replay()
        return self.outputs[size][:len(batch.seq_lens)]

    def fill(self, batch: InputBatch) -> int:
        """Copy ``batch`` into the static buffers and pad it; returns the padded size.

        ``forward(size)`` run eagerly is then exactly what the graph of that size replays.
        """
        n = len(batch.seq_lens)
        size = padded_size(n, self.sizes)
        meta = batch.attn.plan.ragged
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.attn.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].zero_()
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        return size
