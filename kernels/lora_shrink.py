"""LoRA shrink: each token's activations times the A matrix of its adapter's slot.

    out[t] = x[t] @ a[slot[t]].T      (slot[t] >= 0; 0 for base-model tokens)
    x [T, in]   a [S, K, in] (the A matrices of S slots, K = slices x max rank)
    out [T, K] float32

Products and sums in float32. The Triton kernels keep the result float32 for the
expand (no rounding in between); the CPU path returns it in the slots' dtype (see
worker/lora/slot_dtype.py: float32 slots unless the CPU multiplies 16-bit values
faster, as with AVX512-BF16, where bf16 slots measured 5x faster at prefill). ``a``
may have any strides: the worker stores it ``[S, in, K]``-contiguous and passes the
transposed view, so the CPU path multiplies a plain row-major ``[in, K]`` operand (the
faster GEMM at the few rows of a decode run, see worker/models/linear.py).

Three implementations of one contract: the reference (the spec), a Triton kernel (one
program per tile of one slot's rows, see kernels/lora_mapping.py) and the CPU path
(one matmul per run of same-slot tokens; measured in benchmarks/lora_kernels.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.lora_mapping import LoRAMapping, group_tile


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor,
                          token_slots: torch.Tensor) -> torch.Tensor:
    """The spec, token by token (gathers each token's A: for tests, not for speed)."""
    slots = token_slots.long()
    has = slots >= 0
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    if has.any():
        a_tok = a[slots[has]].float()  # [n, K, in]
        out[has] = torch.einsum("ti,tki->tk", x[has].float(), a_tok)
    return out


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ids_ptr, group_slots_ptr,
                        group_starts_ptr, stride_xt, stride_as, stride_ak, stride_ai,
                        stride_ot, IN: tl.constexpr, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_I: tl.constexpr, UPCAST: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    # grid: (group, row tile within the group, tile of the K outputs)
    slot, tok, row_ok, has_rows = group_tile(sorted_ids_ptr, group_slots_ptr,
                                             group_starts_ptr, BLOCK_M)
    if not has_rows:
        return
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i0 in range(0, IN, BLOCK_I):  # x and a share a dtype (the model's on a GPU)
        i = i0 + tl.arange(0, BLOCK_I)
        i_ok = i < IN
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + i[None, :],
                     mask=row_ok[:, None] & i_ok[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_ak
                     + i[:, None] * stride_ai, mask=i_ok[:, None] & col_ok[None, :],
                     other=0.0)  # [BLOCK_I, BLOCK_N] = a[slot, cols, i].T
        if UPCAST:  # the interpreter computes bf16 arithmetic wrongly
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
    tl.store(out_ptr + tok[:, None] * stride_ot + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast after loading, tl.dot precision) for operands of ``dtype``: float32 stays
    exact ("ieee", not tf32); the interpreter must upcast 16-bit values."""
    upcast = os.environ.get("TRITON_INTERPRET", "0") == "1" and dtype != torch.float32
    exact = dtype == torch.float32 or upcast
    return upcast, "ieee" if exact else "tf32"


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor,
                       mapping: LoRAMapping) -> torch.Tensor:
    """The Triton kernel (also runs on CPU tensors under ``TRITON_INTERPRET=1``)."""
    num_tokens, hidden = x.shape
    num_out = a.shape[1]
    out = torch.zeros(num_tokens, num_out, dtype=torch.float32, device=x.device)
    if mapping.max_group_rows == 0:
        return out
    assert x.stride(1) == 1 and x.dtype == a.dtype, "contiguous rows, one dtype"
    block_m, block_n = 16, max(16, min(64, triton.next_power_of_2(num_out)))
    block_i = max(16, min(128, triton.next_power_of_2(hidden)))
    upcast, precision = dot_options(x.dtype)
    grid = (mapping.group_slots.shape[0], triton.cdiv(mapping.max_group_rows, block_m),
            triton.cdiv(num_out, block_n))
    _lora_shrink_kernel[grid](
        x, a, out, mapping.sorted_token_ids, mapping.group_slots, mapping.group_starts,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), out.stride(0),
        IN=hidden, K=num_out, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_I=block_i,
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=4)
    return out


def lora_shrink_cpu(x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """One matmul per run of same-slot tokens (slices of x, no gather), in the slots'
    dtype: float32 slots widen the rows once (float32 result), 16-bit slots on a CPU
    with 16-bit arithmetic multiply natively (float32 sums, a 16-bit result)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=a.dtype, device=x.device)
    if not mapping.runs:
        return out
    lo, hi = mapping.runs[0].start, mapping.runs[-1].end
    xs = x[lo:hi].to(a.dtype)  # widened once for all runs (a no-op in the same dtype)
    for run in mapping.runs:
        rows, part = slice(run.start, run.end), slice(run.start - lo, run.end - lo)
        torch.mm(xs[part], a[run.slot].t(), out=out[rows])
    return out


def lora_shrink(x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``x`` ``[T, in]`` times each token's slot of ``a`` ``[S, K, in]`` → ``[T, K]``:
    CUDA takes the Triton kernel, the CPU the per-run path."""
    if x.is_cuda:
        return lora_shrink_triton(x, a, mapping)
    return lora_shrink_cpu(x, a, mapping)
