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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.device import cpu_has_native_half

# Rows (tokens) from which widening beats the native bf16 GEMM on a CPU without bf16
# instructions: measured crossover between 64 and 128 rows for SmolLM2's projections.
WIDEN_MIN_ROWS = 64


def needs_widening(x: torch.Tensor) -> bool:
    """True when ``x @ W.T`` should run in float32 (see the module docstring)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu"
            and x.shape[0] >= WIDEN_MIN_ROWS and not cpu_has_native_half(x.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that widens 16-bit operands to float32 where that is faster."""
    if not needs_widening(x):
        return F.linear(x, weight, bias)
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` computing through :func:`linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
