"""The Triton rotary-embedding kernel (the GPU backend of kernels.rotary_embedding).

One program per token rotates every head of its q and k, in float32, rounding once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(out_ptr, x_ptr, stride_xt, stride_xh, token, c, s,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    src = x_ptr + token * stride_xt + heads * stride_xh + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (token * NUM_HEADS + heads) * (2 * HALF) + cols
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * c - x2 * s).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(q_out_ptr, k_out_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    # One program per token: its angles are loaded once for all q and k heads.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    c = tl.load(cos_ptr + token * stride_cos + cols, mask=cols < HALF, other=0.0)
    s = tl.load(sin_ptr + token * stride_sin + cols, mask=cols < HALF, other=0.0)
    c = c.to(tl.float32)
    s = s.to(tl.float32)
    _rotate_heads(q_out_ptr, q_ptr, stride_qt, stride_qh, token, c, s,
                  NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_out_ptr, k_ptr, stride_kt, stride_kh, token, c, s,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def rotary_embedding_triton(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; returns new contiguous tensors (inputs may be strided views)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert query.stride(2) == 1 and key.stride(2) == 1
    cos, sin = cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q_out, k_out, query, key, cos, sin, query.stride(0), query.stride(1),
            key.stride(0), key.stride(1), cos.stride(0), sin.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=half,
            HALF_PAD=triton.next_power_of_2(half), num_warps=4)
    return q_out, k_out
