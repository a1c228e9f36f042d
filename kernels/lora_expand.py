"""LoRA expand: add each token's shrunk activations times the B matrix of its slot.

    y[t] += xa[t] @ b[slot[t]].T      (slot[t] >= 0; base-model rows are not touched)
    y [T, N] (updated in place; may be a column slice of a wider output)
    xa [T, K] (the shrink's)   b [S, N, K] (S slots' B, the scale folded in)

The delta is computed with float32 sums and added to y with one rounding to y's dtype. A
fused projection (q/k/v, gate/up) calls this once per slice: ``y`` is then the slice's
columns of the fused output, ``xa`` the slice's columns of the shrink and ``b`` the
slice's rows of the stacked B. Every (row, column) of y is written by exactly one
Triton program, so no atomics are needed. Same three implementations as the shrink
(kernels/lora_shrink.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_mapping import LoRAMapping, group_tile
from kernels.lora_shrink import dot_options


def lora_expand_reference(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                          token_slots: torch.Tensor) -> None:
    """The spec, token by token (gathers each token's B: for tests, not for speed)."""
    slots = token_slots.long()
    has = slots >= 0
    if not has.any():
        return
    delta = torch.einsum("tk,tnk->tn", xa[has].float(), b[slots[has]].float())
    y[has] = (y[has].float() + delta).to(y.dtype)


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


def lora_expand_cpu(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                    mapping: LoRAMapping) -> None:
    """Per run of same-slot tokens (slices, no gather). Slots in ``y``'s dtype: an addmm
    straight into y's rows (float32 sums, one rounding). Float32 slots under 16-bit
    activations: each run's product into one contiguous float32 delta over the rows
    the runs span, then one add into y; adding into y's rows run by run (a strided
    column slice of the fused output) measured 1.5-9x slower there on a busy CPU
    (benchmarks/lora_kernels.py)."""
    if not mapping.runs:
        return
    if b.dtype == y.dtype == xa.dtype:
        for run in mapping.runs:
            y[run.start:run.end].addmm_(xa[run.start:run.end], b[run.slot].t())
        return
    lo, hi = mapping.runs[0].start, mapping.runs[-1].end  # runs are in token order
    delta = torch.zeros(hi - lo, y.shape[1], dtype=torch.float32, device=y.device)
    for run in mapping.runs:
        b_t = b[run.slot].t().float()  # a view when the slots are float32
        delta[run.start - lo:run.end - lo].addmm_(xa[run.start:run.end].float(), b_t)
    y[lo:hi] += delta


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                mapping: LoRAMapping) -> None:
    """``y[t] += xa[t] @ b[slot[t]].T`` in place: CUDA takes the Triton kernel, the CPU
    the per-run path."""
    if y.is_cuda:
        lora_expand_triton(y, xa, b, mapping)
    else:
        lora_expand_cpu(y, xa, b, mapping)
