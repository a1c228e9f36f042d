"""RMS normalisation, optionally fused with the residual add before it.

Per row of ``x`` ``[T, hidden]`` (with ``residual``: ``x = x + residual`` first, rounded
to x's dtype, and that sum is also returned as the new residual)::

    out = weight * (x / sqrt(mean(x^2) + eps)).to(dtype)      statistics in float32

On a GPU the unfused version is four to six kernels per norm (add, cast, square-mean,
scale, cast, multiply), each a full pass over the activations; the Triton kernel reads
x and the residual once and writes both outputs once. On the CPU the native kernel
(``csrc/rms_norm.cpp``) does the same in one pass per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """The spec: ``out`` or ``(out, new_residual)`` when a residual is given."""
    if residual is not None:
        x = x + residual
        residual = x
    h = F.rms_norm(x.float(), weight.shape, eps=eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """The native CPU kernel (``csrc/rms_norm.cpp``); same contract as the reference for
    a 2-D ``x`` whose dtype the weight shares."""
    out, new_residual = cpu_extension.require().rms_norm(x, weight, eps, residual)
    return out if residual is None else (out, new_residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """``x`` ``[T, hidden]``: CUDA takes the fused Triton kernel, the CPU the native one
    when it is built and the dtypes match (else the reference)."""
    if x.is_cuda:  # Triton is loaded by the GPU path only (a CPU worker never needs it)
        from kernels.triton_rms_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual)
    if (x.dim() == 2 and weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype)
            and cpu_extension.is_available()):
        return rms_norm_cpu(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
