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
import triton
import triton.language as tl

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


@triton.jit
def _rms_norm_kernel(out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, eps, stride_x, stride_res,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # One program per row. Rounding follows the reference step by step: the sum is
    # rounded to the activation dtype before its statistics are taken, the normalised
    # value is rounded before the weight multiplies it (a product of two 16-bit values
    # is exact in float32, so one final rounding equals the reference's).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * HIDDEN + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    h = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """The Triton kernel; same contract as the reference (2-D ``x``)."""
    num_rows, hidden = x.shape
    x = _rows(x)
    out = torch.empty((num_rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    res_in = _rows(residual) if residual is not None else x
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            out, res_out, x, res_in, weight, eps, x.stride(0), res_in.stride(0),
            HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None, num_warps=4 if hidden <= 4096 else 8)
    return out if residual is None else (out, res_out)


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
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, residual)
    if (x.dim() == 2 and weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype)
            and cpu_extension.is_available()):
        return rms_norm_cpu(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
