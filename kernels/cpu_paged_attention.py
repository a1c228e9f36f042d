"""Native CPU paged attention: decode (``csrc/paged_attention_decode.cpp``) and the causal
attention of a step's fresh prompt segments on AMX tiles (``csrc/prefill_attention.cpp``).

The kernel is part of the native CPU extension (:mod:`kernels.cpu_extension`), which is
built at first use; :func:`is_available` says whether it loaded, and callers fall back to
the torch reference in ``kernels.paged_attention`` when it did not.
"""
from __future__ import annotations

import torch

from kernels import cpu_extension
from kernels.cpu_extension import DISABLE_ENV, is_available, unavailable_reason

__all__ = ["DISABLE_ENV", "V_PASSES", "decode_v_passes", "is_available", "v_pass_index",
           "paged_attention_decode", "prefill_attention", "prefill_attention_available",
           "prefill_attention_on_tiles", "unavailable_reason"]

# The decode kernel's V passes for a bf16 cache under bf16 queries: "widened" (values
# widened to float32, FMAs; the default) and, built with AVX512-BF16, "paired" (two keys
# a lane with `vdpbf16ps`, probabilities rounded to bf16; opt-in through
# worker.decode_v_pass, see worker/decode_v_pass.py). Other dtypes always widen.
V_PASSES = ("widened", "paired")
_V_PASS_INDEX = {name: i for i, name in enumerate(V_PASSES)}

_prefill_available: bool | None = None


def paged_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, sliding_window: int | None = None,
                           batch_invariant: bool = False,
                           v_pass: str = "widened") -> torch.Tensor:
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

    With ``batch_invariant`` a request's result has the same bits whatever else is in the
    batch and at any thread count; without it, one or two requests' keys are split
    finer over the threads, which changes the order of their sums. ``v_pass`` (one of
    :func:`decode_v_passes`) is the V pass of a bf16 cache under bf16 queries.
    """
    ops = cpu_extension.require()
    if block_tables.dtype != torch.int64:
        block_tables = block_tables.to(torch.int64)
    if seq_lens.dtype != torch.int64:
        seq_lens = seq_lens.to(torch.int64)
    return ops.paged_attention_decode(query, kv_cache, block_tables, seq_lens, float(scale),
                                      sliding_window, batch_invariant, v_pass_index(v_pass))


_v_passes: tuple[str, ...] | None = None


def decode_v_passes() -> tuple[str, ...]:
    """The V passes this build of the decode kernel has."""
    global _v_passes
    if _v_passes is None:
        _v_passes = V_PASSES[:cpu_extension.require().decode_v_passes()]
    return _v_passes


def v_pass_index(name: str) -> int:
    """The native ops' ``v_pass`` argument for V pass ``name``; ValueError if it is not
    built here."""
    index = _V_PASS_INDEX.get(name)
    if index is None or index >= len(decode_v_passes()):
        raise ValueError(f"decode V pass {name!r} is not built here; "
                         f"have {', '.join(decode_v_passes())}")
    return index


def prefill_attention_available() -> bool:
    """Whether the prefill kernel runs here: the extension built with AVX512-BF16 (on AMX
    tiles where :func:`prefill_attention_on_tiles`, else on AVX512-BF16 dot products)."""
    global _prefill_available
    if _prefill_available is None:
        _prefill_available = is_available() and bool(
            cpu_extension.require().prefill_attention_available())
    return _prefill_available


def prefill_attention_on_tiles() -> bool:
    """Whether the prefill kernel runs on AMX tiles (built with AMX-BF16, and the kernel
    granted the process the tile state, asked once)."""
    return prefill_attention_available() and bool(
        cpu_extension.require().prefill_attention_on_tiles())


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      seg_starts: torch.Tensor, seg_lens: torch.Tensor, scale: float,
                      out: torch.Tensor) -> torch.Tensor:
    """Causal attention of prompt segments whose keys are all this step's own tokens.

    ``query``/``out`` ``[T, H, hd]`` and ``key``/``value`` ``[T, kv_heads, hd]``, bf16,
    each token's heads contiguous (token rows may be strided); segment ``s`` is tokens
    ``[seg_starts[s], seg_starts[s] + seg_lens[s])`` (int64), query ``i`` of it sees keys
    ``0..i`` of it. Writes the segments' rows of ``out`` (nothing else) and returns it.
    Needs :func:`prefill_attention_available`.
    """
    cpu_extension.require().prefill_attention(query, key, value, seg_starts, seg_lens,
                                              float(scale), out)
    return out
