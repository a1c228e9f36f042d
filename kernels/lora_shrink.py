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
program per tile of one slot's rows, kernels/triton_lora.py) and the CPU path
(one matmul per run of same-slot tokens; measured in benchmarks/lora_kernels.py).
"""
from __future__ import annotations

import torch

from kernels.lora_mapping import LoRAMapping


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
    if x.is_cuda:  # Triton is loaded by the GPU path only
        from kernels.triton_lora import lora_shrink_triton
        return lora_shrink_triton(x, a, mapping)
    return lora_shrink_cpu(x, a, mapping)
