"""Rounding keys and values into a one-byte (fp8) KV cache, and widening them back.

A quantized cache stores every element as ``round(x / scale)`` in the cache's fp8 format
with ``scale = 1.0`` (vLLM's default when no calibrated scales are given): keys and values
of the models served here sit well inside fp8's range, so one byte keeps 3 (e4m3) or
2 (e5m2) mantissa bits of each. Values beyond the format's largest finite number
saturate to it: a plain cast would turn them into NaN (e4m3 has no infinity) or inf.

Invariant kept by every attention path: a query only ever sees keys and values as the
cache holds them. The reference rounds this step's fresh keys through the cache format
(:func:`round_through_cache`) so that a prompt computed fresh and the same prompt read
back from the cache (prefix-cache hit, chunked prefill) attend to identical numbers.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The format's largest finite value (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def fp8_mantissa_bits(dtype: torch.dtype) -> int:
    """Explicit mantissa bits of an fp8 format; 0 for any other dtype."""
    return _MANTISSA_BITS.get(dtype, 0)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's dtype: saturating round-to-nearest-even for fp8, a plain
    cast otherwise."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = fp8_max(cache_dtype)
    return x.clamp(-limit, limit).to(cache_dtype)


def round_through_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a read from a cache of ``cache_dtype`` gives it back (in x's dtype); ``x``
    itself when the cache holds x's dtype (the default: no extra work)."""
    if cache_dtype == x.dtype:
        return x
    return quantize_kv(x, cache_dtype).to(x.dtype)
