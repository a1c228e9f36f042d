"""Ragged attention batches for the kernel tests: random caches scattered over blocks.

``make_case`` lays requests out decodes first (as the runner does), writes each
request's cached context and this step's keys into shuffled, non-contiguous blocks,
and returns everything both the torch reference and the Triton kernel need. Every
request also owns one more, still empty block at the end of its table (the scheduler
allocates ahead), and every slot that holds no key is NaN: a kernel that reads past a
sequence, or fails to mask a partly filled last block, turns its output into NaN.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.paged_attention import make_plan, paged_attention_reference
from kernels.reshape_and_cache import reshape_and_cache_reference

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Interpreted kernels run on CPU tensors; compiled ones need the GPU.
DEVICE = torch.device("cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda")


@dataclass
class RaggedCase:
    """One step's inputs; integer tensors are int32 on DEVICE, as the worker builds them."""

    query: torch.Tensor  # [T, H, hd]
    key: torch.Tensor  # [T, kvh, hd] this step's keys (already in the cache)
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kvh, hd]
    block_tables: torch.Tensor  # [R, max_blocks] int64 on the CPU
    query_start_loc: list[int]
    seq_lens: list[int]

    def device_metadata(self):
        """(block_tables, seq_lens, query_start_loc) as int32 tensors on DEVICE."""
        return (self.block_tables.to(DEVICE, torch.int32),
                torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE),
                torch.tensor(self.query_start_loc, dtype=torch.int32, device=DEVICE))

    @property
    def max_query_len(self) -> int:
        qsl = self.query_start_loc
        return max(b - a for a, b in zip(qsl, qsl[1:]))

    def reference(self, scale: float, window: int | None) -> torch.Tensor:
        """The torch reference on CPU copies (the spec)."""
        block_size = self.kv_cache.shape[2]
        plan = make_plan(self.query_start_loc, self.seq_lens, self.block_tables, block_size,
                         window)
        return paged_attention_reference(self.query.cpu(), self.key.cpu(), self.value.cpu(),
                                         self.kv_cache.cpu(), plan, scale)


def make_case(shapes: list[tuple[int, int]], block_size: int, num_heads: int,
              num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
              spare_blocks: int = 3) -> RaggedCase:
    """``shapes``: ``(context_len, query_len)`` per request, reordered decodes first."""
    gen = torch.Generator().manual_seed(seed)
    shapes = sorted(shapes, key=lambda s: s[1] != 1)
    blocks = [-(-(c + q) // block_size) + 1 for c, q in shapes]  # + an empty last block
    max_blocks = max(blocks)
    num_blocks = 1 + sum(blocks) + spare_blocks
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int64)
    qsl, seq_lens, queries, keys, values, slots = [0], [], [], [], [], []
    used = 0
    for r, (c, q) in enumerate(shapes):
        tables[r, :blocks[r]] = torch.tensor(perm[used:used + blocks[r]])
        used += blocks[r]
        pos = torch.arange(c + q)
        slot = tables[r, pos // block_size] * block_size + pos % block_size
        k = torch.randn(c + q, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(c + q, num_kv_heads, head_dim, generator=gen).to(dtype)
        reshape_and_cache_reference(k, v, kv_cache, slot)
        queries.append(torch.randn(q, num_heads, head_dim, generator=gen).to(dtype))
        keys.append(k[c:])
        values.append(v[c:])
        slots.append(slot[c:])
        qsl.append(qsl[-1] + q)
        seq_lens.append(c + q)
    return RaggedCase(torch.cat(queries).to(DEVICE), torch.cat(keys).to(DEVICE),
                      torch.cat(values).to(DEVICE), kv_cache.to(DEVICE), tables, qsl,
                      seq_lens)
