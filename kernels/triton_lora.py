"""The Triton LoRA kernels: shrink and expand (the GPU backends of kernels.lora_shrink and
kernels.lora_expand, whose references are the spec; they also run on CPU tensors under
``TRITON_INTERPRET=1``).

Each program owns a tile of one group's rows (kernels/lora_mapping.py's
``sorted_token_ids``), so one adapter matrix serves the whole tile, whether its rows are
one prefill chunk (SGMV) or decode rows gathered from across the batch (BGMV).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.lora_mapping import LoRAMapping


@triton.jit
def group_tile(sorted_ids_ptr, group_slots_ptr, group_starts_ptr, BLOCK_M: tl.constexpr):
    """The tile of one group's rows a LoRA kernel program owns, on grid axes (group,
    row tile): (slot, token ids, row mask, whether the tile holds any row)."""
    group = tl.program_id(0)
    start = tl.load(group_starts_ptr + group)
    end = tl.load(group_starts_ptr + group + 1)
    first = start + tl.program_id(1) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tok = tl.load(sorted_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    return slot, tok, row_ok, first < end


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


@triton.jit
def _lora_expand_kernel(y_ptr, xa_ptr, b_ptr, sorted_ids_ptr, group_slots_ptr,
                        group_starts_ptr, stride_yt, stride_yn, stride_xt, stride_xk,
                        stride_bs, stride_bn, stride_bk, N: tl.constexpr, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # grid: (group, row tile within the group, tile of the N output columns)
    slot, tok, row_ok, has_rows = group_tile(sorted_ids_ptr, group_slots_ptr,
                                             group_starts_ptr, BLOCK_M)
    if not has_rows:
        return
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(xa_ptr + tok[:, None] * stride_xt + k[None, :] * stride_xk,
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn
                     + k[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :],
                     other=0.0)  # [BLOCK_K, BLOCK_N] = b[slot, cols, k].T
        # xa is float32: B widens to meet it (the expand is a sliver of the layer's work)
        acc += tl.dot(xt, bt.to(tl.float32), input_precision=DOT_PRECISION)
    y_at = y_ptr + tok[:, None] * stride_yt + cols[None, :] * stride_yn
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand_triton(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                       mapping: LoRAMapping) -> None:
    """The Triton kernel (also runs on CPU tensors under ``TRITON_INTERPRET=1``)."""
    if mapping.max_group_rows == 0:
        return
    num_out, rank = b.shape[1], b.shape[2]
    block_m, block_k = 16, max(16, min(64, triton.next_power_of_2(rank)))
    block_n = max(16, min(128, triton.next_power_of_2(num_out)))
    _, precision = dot_options(y.dtype)
    grid = (mapping.group_slots.shape[0], triton.cdiv(mapping.max_group_rows, block_m),
            triton.cdiv(num_out, block_n))
    _lora_expand_kernel[grid](
        y, xa, b, mapping.sorted_token_ids, mapping.group_slots, mapping.group_starts,
        y.stride(0), y.stride(1), xa.stride(0), xa.stride(1),
        b.stride(0), b.stride(1), b.stride(2), N=num_out, K=rank,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
        num_warps=4)
