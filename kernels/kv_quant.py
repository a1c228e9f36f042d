"""Rounding keys and values into a one-byte (fp8 or int8) KV cache, and widening them back.

An fp8 cache stores every element as ``round(x / scale)`` in the cache's fp8 format
with ``scale = 1.0`` (vLLM's default when no calibrated scales are given): keys and values
of the models served here sit well inside fp8's range, so one byte keeps 3 (e4m3) or
2 (e5m2) mantissa bits of each. Values beyond the format's largest finite number
saturate to it: a plain cast would turn them into NaN (e4m3 has no infinity) or inf.

An int8 cache keeps a scale per token and KV head instead: each head's row of head_dim
values is stored as ``round(x / s)`` in [-127, 127] with ``s = max|x| / 127``, and ``s``
itself (bfloat16, rounded up so that no value clips) in the row's last two bytes::

    int8 row [head_dim + 2]:  [ q_0 q_1 ... q_{hd-1} | s (bf16 bits) ]    x_i ~= q_i * s

The values are rounded against the stored scale, so the scale's own rounding costs no
accuracy. One KV head of 64 values then takes 66 bytes against bfloat16's 128: 1.94x the
tokens for the same bytes.

Invariant kept by every attention path: a query only ever sees keys and values as the
cache holds them. The reference rounds this step's fresh keys through the cache format
(:func:`round_through_cache`) so that a prompt computed fresh and the same prompt read
back from the cache (prefix-cache hit, chunked prefill) attend to identical numbers.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
INT8_SCALE_BYTES = 2  # a bfloat16 scale at the end of each int8 head row


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one head's row in the cache: head_dim, plus the scale's bytes for int8."""
    return head_dim + (INT8_SCALE_BYTES if cache_dtype == torch.int8 else 0)


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as int8 rows ``[..., head_dim + 2]`` (values, then scale)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # bf16 keeps 8 mantissa bits: nudging up by 2^-8 before rounding to nearest makes the
    # stored scale >= amax / 127, so no value rounds past 127
    scale = (amax * (1.0 + 2.0 ** -8) / 127).clamp(min=1e-30).to(torch.bfloat16)
    q = torch.round(xf / scale.float()).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_int8_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows ``[..., head_dim + 2]`` back to ``[..., head_dim]`` values of ``dtype``."""
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.bfloat16).float()
    return (rows[..., :-INT8_SCALE_BYTES].float() * scale).to(dtype)


def load_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (any stored dtype) as ``dtype`` values."""
    if rows.dtype == torch.int8:
        return dequantize_int8_rows(rows, dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)


def fp8_max(dtype: torch.dtype) -> float:
    """The format's largest finite value (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def fp8_mantissa_bits(dtype: torch.dtype) -> int:
    """Explicit mantissa bits of an fp8 format; 0 for any other dtype."""
    return _MANTISSA_BITS.get(dtype, 0)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's dtype: saturating round-to-nearest-even for fp8, int8 rows
    with their scale for int8 (one more dim's worth of bytes), a plain cast otherwise."""
    if cache_dtype == torch.int8:
        return quantize_int8_rows(x)
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = fp8_max(cache_dtype)
    return x.clamp(-limit, limit).to(cache_dtype)


def round_through_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a read from a cache of ``cache_dtype`` gives it back (in x's dtype); ``x``
    itself when the cache holds x's dtype (the default: no extra work)."""
    if cache_dtype == x.dtype:
        return x
    return load_kv(quantize_kv(x, cache_dtype), x.dtype)
