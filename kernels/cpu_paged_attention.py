"""Native CPU decode paged attention (``csrc/paged_attention_decode.cpp``).

The kernel is part of the native CPU extension (:mod:`kernels.cpu_extension`), which is
built at first use; :func:`is_available` says whether it loaded, and callers fall back to
the torch reference in ``kernels.paged_attention`` when it did not.
"""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.cpu_extension import DISABLE_ENV, is_available, unavailable_reason

__all__ = ["DISABLE_ENV", "is_available", "paged_attention_decode", "unavailable_reason"]


def paged_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query token per request over its paged keys and values.

    ``query`` ``[num_decodes, num_heads, head_dim]``; ``kv_cache`` contiguous
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` of the query's dtype
    (float32, bfloat16 or float16) or fp8 (float8_e4m3fn / float8_e5m2, scale 1.0,
    widened as loaded), already holding this step's keys and values;
    ``block_tables`` ``[num_decodes, max_blocks]`` int64 (other integer dtypes are
    converted, at the cost of a copy); ``seq_lens`` ``[num_decodes]`` int64, the keys
    each request attends to (its own token included). Query head ``h`` reads kv head
    ``h // (num_heads // num_kv_heads)``; with ``sliding_window`` W a request sees only
    positions ``>= seq_len - W``. Returns ``[num_decodes, num_heads, head_dim]`` in the
    query's dtype (float32 accumulation inside). A request with seq_len 0 gets zeros.
    """
    ops = cpu_extension.require()
    if block_tables.dtype != torch.int64:
        block_tables = block_tables.to(torch.int64)
    if seq_lens.dtype != torch.int64:
        seq_lens = seq_lens.to(torch.int64)
    return ops.paged_attention_decode(query, kv_cache, block_tables, seq_lens, float(scale),
                                      sliding_window)
