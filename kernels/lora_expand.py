"""LoRA expand: add each token's shrunk activations times the B matrix of its slot.

    y[t] += xa[t] @ b[slot[t]].T      (slot[t] >= 0; base-model rows are not touched)
    y [T, N] (updated in place; may be a column slice of a wider output)
    xa [T, K] (the shrink's)   b [S, N, K] (S slots' B, the scale folded in)

The delta is computed with float32 sums and added to y with one rounding to y's dtype. A
fused projection (q/k/v, gate/up) calls this once per slice: ``y`` is then the slice's
columns of the fused output, ``xa`` the slice's columns of the shrink and ``b`` the
slice's rows of the stacked B. Every (row, column) of y is written by exactly one
Triton program (kernels/triton_lora.py), so no atomics are needed. Same three
implementations as the shrink (kernels/lora_shrink.py).
"""
from __future__ import annotations

import torch

from kernels.lora_mapping import LoRAMapping


def lora_expand_reference(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                          token_slots: torch.Tensor) -> None:
    """The spec, token by token (gathers each token's B: for tests, not for speed)."""
    slots = token_slots.long()
    has = slots >= 0
    if not has.any():
        return
    delta = torch.einsum("tk,tnk->tn", xa[has].float(), b[slots[has]].float())
    y[has] = (y[has].float() + delta).to(y.dtype)


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
    if y.is_cuda:  # Triton is loaded by the GPU path only
        from kernels.triton_lora import lora_expand_triton
        lora_expand_triton(y, xa, b, mapping)
    else:
        lora_expand_cpu(y, xa, b, mapping)
