"""``x @ W.T (+ bias)`` on a GPU with W in Folio's packed Q4_0/Q4_1/Q8_0 layout: a
Triton dequant-GEMM that reads the quantized bytes and unpacks them in registers.

The layout is the CPU kernels' (kernels/quant_linear.py, ``csrc/quant_pack.h``): rows in
groups of 16, and for group ``g`` and block ``b`` of 32 columns::

    qs[g, b, :]   Q8_0: byte 64c + 4j + t   = u[row 16g + j, k = 32b + 4c + t]
                  Q4_*: byte 64c + 4j + t   = u[.., 32b + 8c + t] | u[.., 32b + 8c + 4 + t] << 4
    scales[g, b]  d of the 16 rows, then (Q4_1) m of the 16 rows

    w[row, k] = d * (u - offset) (+ m)       offset 8 (Q4_0), 0 (Q4_1), 128 (Q8_0)

One program computes a ``BLOCK_M x BLOCK_N`` tile of the output: per step of
``BLOCK_K`` columns it loads the x tile, gathers the weight bytes and scales of its
``BLOCK_N`` rows, widens them to x's dtype and accumulates ``tl.dot`` in float32. The
reference is :func:`kernels.quant_linear.dequantize` followed by ``F.linear``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.quant_linear import BLOCK, GROUP_ROWS, Q4_1, Q8_0, PackedWeight

_OFFSET = {2: 8, Q4_1: 0, Q8_0: 128}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _quant_linear_kernel(x_ptr, qs_ptr, sc_ptr, bias_ptr, y_ptr, M, N, K, num_groups,
                         stride_xm, stride_ym, IS_Q8: tl.constexpr, HAS_MIN: tl.constexpr,
                         OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # may run past N into the padded group
    g = rn // 16
    j = rn % 16
    held = (g < num_groups)[:, None]  # rows past the last packed group read nothing
    num_blocks = K // 32
    QS_BYTES: tl.constexpr = 512 if IS_Q8 else 256  # 16 rows x 32 k, 8 or 4 bits
    S: tl.constexpr = 32 if HAS_MIN else 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rm[:, None] < M,
                    other=0.0)
        b = rk // 32
        kin = rk % 32
        # [BLOCK_N, BLOCK_K] addresses into qs, scales for each (row, k)
        gb = g[:, None] * num_blocks + b[None, :]
        if IS_Q8:
            byte = gb * QS_BYTES + (kin[None, :] // 4) * 64 + j[:, None] * 4 + kin[None, :] % 4
            u = tl.load(qs_ptr + byte, mask=held, other=0).to(tl.int32)
        else:
            byte = gb * QS_BYTES + (kin[None, :] // 8) * 64 + j[:, None] * 4 + kin[None, :] % 4
            shift = ((kin[None, :] // 4) % 2) * 4
            u = (tl.load(qs_ptr + byte, mask=held, other=0).to(tl.int32) >> shift) & 15
        d = tl.load(sc_ptr + gb * S + j[:, None], mask=held, other=0.0).to(tl.float32)
        w = (u - OFFSET).to(tl.float32) * d
        if HAS_MIN:
            w += tl.load(sc_ptr + gb * S + 16 + j[:, None], mask=held, other=0.0).to(tl.float32)
        w = w.to(x.dtype)  # the weight rounds to x's dtype, as on the GPU
        if UPCAST:  # the interpreter's bf16 dot is wrong: same values, float32 product
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                          input_precision=PRECISION, out_dtype=tl.float32)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask)


def _block_k(k: int) -> int:
    for size in (128, 64, 32):  # whole quant blocks per step, dividing K
        if k % size == 0:
            return size
    raise ValueError(f"in-features {k} is not a multiple of {BLOCK}")


def quant_linear_triton(x: torch.Tensor, p: PackedWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(p).T (+ bias)`` in x's dtype, x ``[..., k]`` on p's device."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, p.n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if p.n >= 64 else 32 if p.n > GROUP_ROWS else GROUP_ROWS
    grid = (triton.cdiv(m, block_m), triton.cdiv(p.n, block_n))
    upcast = _interpreting() and x.dtype == torch.bfloat16
    _quant_linear_kernel[grid](
        x2, p.qs, p.scales, bias if bias is not None else y, y, m, p.n, p.k, p.qs.shape[0],
        x2.stride(0), y.stride(0), IS_Q8=p.fmt == Q8_0, HAS_MIN=p.fmt == Q4_1,
        OFFSET=_OFFSET[p.fmt], HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=_block_k(p.k),
        # float32 x stays float32 (no TF32): the result is the reference to float32 rounding
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)
    return y.reshape(*x.shape[:-1], p.n)
