"""Linear layers laid out and dispatched for fast CPU matmuls.

Two measured effects on a 2-core AVX-512 CPU (SmolLM2's projection shapes):

* Weight layout. ``F.linear`` with the usual ``[out, in]`` row-major weight runs the
  GEMM with a transposed B operand, which at 4-32 rows (the decode batches of a small
  server) measured 1.5-5x slower than the same product on a weight stored K-major
  (``[in, out]`` contiguous, seen as ``[out, in]`` through ``.t()``); from 64 rows on
  the two are equal. :func:`use_k_major_weights` re-lays every weight once at load;
  the parameters keep their shapes and names, only their strides change.
* Half precision without half arithmetic. A CPU without AVX512-BF16/AMX (AVX512-FP16
  for float16) has no 16-bit multiply: its bf16 GEMM widens operand tiles to float32
  inside the kernel and measured 36-42 GFLOP/s, against 90-200 for float32 from 64
  rows on. Widening the whole weight once per call and running the float32 GEMM computes
  the same thing (float32 products and sums, one rounding of the output) and wins once
  there are enough rows to amortise the widening; with fewer rows the call is bound by
  reading the weight, and the native path, which reads half the bytes, stays faster.
* The native 16-bit kernel (``kernels/csrc/half_linear.cpp``) has both: it reads the
  16-bit weight once, widening in registers, and multiplies in float32 at close to the
  float32 GEMM's rate. Over all of SmolLM2's projections and its LM head (weights
  streaming from memory, as in a decode step), bf16 through it took 21 / 99 / 188 ms
  at 1 / 32 / 64 rows, against 27 / 279 / 467 ms (1 / 32 / 63 rows) for the native
  GEMM, 330 ms for widening at 64 rows and 37 / 149 / 217 ms for float32 weights. It
  reads the usual ``[out, in]`` row-major weight, so with it the weights stay as loaded.
  From 256 rows on (prefill) widening catches up and the float32 GEMM's better blocking
  wins.

:func:`half_path` is the fixed rule; a layer given a measured choice
(worker/linear_backend.py, which times every path of worker/models/linear_paths.py on
the model's own shapes) follows that instead, and so does :func:`linear`.

Deterministic mode (``worker.deterministic``) needs every row's result to be the same
bits whatever other rows share the call, and a choice by row count (the rule's or the
measured one) breaks that. :func:`invariant_linear` therefore takes one path per dtype
(16-bit weights on a CPU without 16-bit arithmetic always take the native kernel, whose
outputs each sum their K products in one fixed order whatever the row count) and runs
torch's GEMMs on tiles of exactly ``INVARIANT_ROW_MULTIPLE`` rows, one call per tile, the
last one zero-padded: the GEMM libraries choose their kernels (and so their order of
sums) by the whole shape, M included. Padding the rows to a multiple of 8 and making one
call was enough on the AMD and older Intel AVX-512 CPUs here, and 2-10x faster on
prefill, but on an AMX Xeon (family 6 model 167) both the float32 and the bf16 GEMM
changed rows' bits between 8, 16, 64 and 100 rows, and so did one batched call over
tiles; one call per tile of 8 kept every row identical on every CPU tried.
tests/worker/test_invariant_linear.py checks this on the machine it runs on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_extension
from kernels.quant_linear import PackedWeight
from worker.device import cpu_has_native_half
from worker.models.linear_paths import (HALF_DTYPES, KERNEL, MKLDNN, NATIVE, WIDEN,
                                        LinearChoice, candidates, kernel_takes, run_path)

# Rows (tokens) from which widening beats the native bf16 GEMM on a CPU without bf16
# instructions: measured crossover between 64 and 128 rows for SmolLM2's projections.
WIDEN_MIN_ROWS = 64
# Rows below which the native 16-bit kernel runs. Over SmolLM2's layers widening ties
# with it at 256 rows and wins beyond (the float32 GEMM's blocking), so prefill widens.
HALF_KERNEL_MAX_ROWS = 256


def lacks_half_arithmetic(dtype: torch.dtype, device: torch.device) -> bool:
    """A 16-bit ``dtype`` on a CPU that cannot multiply it natively."""
    return dtype in HALF_DTYPES and device.type == "cpu" and not cpu_has_native_half(dtype)


def half_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """How ``x @ weight.T`` runs: NATIVE (plain ``F.linear``), KERNEL (the native 16-bit
    kernel) or WIDEN (both operands widened to float32); see the module docstring."""
    rows = x.shape[0] if x.dim() == 2 else (x.numel() // x.shape[-1] if x.shape[-1] else 0)
    return _half_path(rows, x.dtype, x.device, weight)


def _half_path(rows: int, dtype: torch.dtype, device: torch.device, weight) -> str:
    if weight.dtype != dtype or not lacks_half_arithmetic(dtype, device):
        return NATIVE
    if rows < HALF_KERNEL_MAX_ROWS and kernel_takes(weight):
        return KERNEL
    return WIDEN if rows >= WIDEN_MIN_ROWS else NATIVE


def linear_path(rows: int, dtype: torch.dtype, device: torch.device, weight,
                choice: LinearChoice | None = None) -> str:
    """The path :func:`linear` takes for ``rows`` rows of ``dtype`` activations: the
    layer's measured ``choice`` if it has one, else the fixed rule (:func:`half_path`;
    a quantized weight runs its kernel's default). The mkldnn path multiplies bf16 only:
    other activations take the native GEMM."""
    if choice is not None:
        path = choice.path_for(rows)
        return NATIVE if path == MKLDNN and dtype != torch.bfloat16 else path
    if isinstance(weight, PackedWeight):
        return candidates(weight)[0]
    if dtype not in HALF_DTYPES:  # float32: no decision to make
        return NATIVE
    return _half_path(rows, dtype, device, weight)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           choice: LinearChoice | None = None) -> torch.Tensor:
    """``F.linear`` through :func:`linear_path`'s path for x's rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return run_path(linear_path(rows, x.dtype, x.device, weight, choice), x, weight, bias)


# Row counts are padded to a multiple of this, so the float32 GEMM never leaves 1-3 rows
# to its other kernel (see the module docstring).
INVARIANT_ROW_MULTIPLE = 8


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose row ``i`` depends on ``x[i]`` alone, never on the row count
    (deterministic mode): one path per dtype, the rows zero-padded to a multiple of
    ``INVARIANT_ROW_MULTIPLE``."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    rows = x.shape[0]
    pad = -rows % INVARIANT_ROW_MULTIPLE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    widen = lacks_half_arithmetic(x.dtype, x.device)
    if widen and kernel_takes(weight):  # one fixed K order per output, at any row count
        out = cpu_extension.require().half_linear(x, weight, bias)
    else:
        if widen:
            weight = weight.float()
            bias = None if bias is None else bias.float()
        # one GEMM call per tile of rows: every row meets the same kernel
        out = torch.cat([F.linear(x[i:i + INVARIANT_ROW_MULTIPLE].to(weight.dtype), weight,
                                  bias).to(x.dtype)
                         for i in range(0, x.shape[0], INVARIANT_ROW_MULTIPLE)])
    return out[:rows].reshape(*shape[:-1], weight.shape[0])


def wants_k_major(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are re-laid K-major on this CPU: float32 yes (its
    GEMM is faster so); 16-bit weights stay row-major where the native kernel can read
    them, so the measured choice can pick it (an AMX CPU measured K-major bf16 as the
    slowest layout at every row count, and the kernel 2.2x faster at one row)."""
    return dtype not in HALF_DTYPES or not cpu_extension.is_available()


class Linear(nn.Linear):
    """``nn.Linear`` computing through :func:`linear` (same parameters and names);
    ``choice`` is the measured path per row count, set at load."""

    choice: LinearChoice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.choice)


class InvariantLinear(Linear):
    """A :class:`Linear` computing through :func:`invariant_linear` (deterministic mode;
    :func:`use_invariant_linears` turns a model's layers into these in place, so the
    default layers carry no switch at all)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def use_invariant_linears(model: nn.Module) -> int:
    """Make every :class:`Linear` of ``model`` an :class:`InvariantLinear` (same
    parameters, names and layout); returns how many."""
    layers = [m for m in model.modules() if type(m) is Linear]
    for layer in layers:
        layer.__class__ = InvariantLinear
    return len(layers)


def k_major(weight: torch.Tensor) -> torch.Tensor:
    """The same ``[out, in]`` values stored ``[in, out]``-contiguous."""
    return weight.detach().t().contiguous().t()


def is_k_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous()


@torch.no_grad()
def use_k_major_weights(model: nn.Module) -> int:
    """Re-lay every :class:`Linear` weight of ``model`` K-major; returns how many.

    Call after the weights are loaded and moved; a later ``copy_`` into a weight keeps
    its layout. Only worth doing on the CPU (see the module docstring)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.weight.data = k_major(layer.weight)
    return len(layers)
