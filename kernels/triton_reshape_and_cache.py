"""The Triton KV-cache write (the GPU backend of kernels.reshape_and_cache; also runs on CPU
tensors under ``TRITON_INTERPRET=1``). One program per token copies its keys and values
into their slot, rounding for an fp8 cache as kernels/kv_quant.py specifies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import fp8_mantissa_bits, fp8_max, is_fp8

@triton.jit
def _to_cache(x, FP8_MANTISSA: tl.constexpr, FP8_MAX: tl.constexpr):
    """``x`` ready to cast to an fp8 cache (unchanged for others): rounded to nearest even
    at FP8_MANTISSA bits in float32 arithmetic, then saturated. The cast that follows is
    then exact for normal numbers on any backend (Triton's interpreter rounds half up and
    loses the carry into the exponent: 31.6 became 16 in e4m3)."""
    if FP8_MANTISSA > 0:
        DROP: tl.constexpr = 23 - FP8_MANTISSA
        # int32 bits: the sign bit makes them negative, the magnitude bits below it
        # still round as unsigned (no overflow: the exponent stays below 255)
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)
        x = (bits & -(1 << DROP)).to(tl.float32, bitcast=True)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              stride_key_token, stride_value_token,
                              ROW: tl.constexpr, BLOCK: tl.constexpr,
                              FP8_MANTISSA: tl.constexpr, FP8_MAX: tl.constexpr):
    # One program per token: its ROW = num_kv_heads * head_dim contiguous elements.
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < tl.where(slot >= 0, ROW, 0)  # a padding token (slot -1) writes nothing
    k = tl.load(key_ptr + token * stride_key_token + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + offs, mask=mask)
    k = _to_cache(k, FP8_MANTISSA, FP8_MAX)
    v = _to_cache(v, FP8_MANTISSA, FP8_MAX)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    # The kernel needs each token's [heads, dim] contiguous; the token stride is free
    # (keys are usually a column slice of the fused qkv output).
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """The Triton kernel (also runs on CPU tensors under ``TRITON_INTERPRET=1``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert kv_cache.dtype != torch.int8, "int8 KV caches are written on the CPU only"
    assert kv_cache.is_contiguous(), "the kernel addresses the cache as [slots, kvh*hd]"
    key, value = _token_rows(key), _token_rows(value)
    row = num_kv_heads * head_dim
    fp8 = is_fp8(kv_cache.dtype)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), value.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row),
        FP8_MANTISSA=fp8_mantissa_bits(kv_cache.dtype),
        FP8_MAX=fp8_max(kv_cache.dtype) if fp8 else 0.0)
