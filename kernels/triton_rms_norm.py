"""The Triton RMS-norm kernel (the GPU backend of kernels.rms_norm; its reference is the spec).

One program per row reads x and the residual once and writes both outputs once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
