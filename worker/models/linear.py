"""Linear layers that stay fast with half-precision weights on CPUs without half arithmetic.

A CPU without AVX512-BF16/AMX (or AVX512-FP16 for float16) has no instruction that
multiplies 16-bit floats: its bf16 GEMM widens every operand tile to float32 inside the
kernel, and measured on such a CPU (2 cores, AVX-512) that runs at 36-42 GFLOP/s against
90-200 GFLOP/s for float32 at 64 or more rows. Widening the whole weight to float32 once
per call and running the float32 GEMM computes the same thing (products and sums in
float32, one rounding of the output to the weight's dtype) and wins once the matmul has
enough rows to amortise the widening; with few rows the call is bound by reading the
weight, and the native 16-bit path, which reads half the bytes, stays faster.

Float32 weights on a CPU with MKL are also packed once into MKL's GEMM layout
(``cblas_sgemm_pack``): the packed GEMM skips re-tiling the weight on every call, which
measured 1.5-2x faster than ``F.linear`` from 32 to 512 rows on this machine. The packed
copy is an extra buffer next to the weight (the weight itself stays for loading and
for the LM head's tied embedding).
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


# The row count MKL is told to pack for; any row count gives the same result (checked
# in the tests), this one only tunes the layout.
PACK_ROWS = 64


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can use MKL's packed GEMM (float32 on a CPU with MKL)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


class Linear(nn.Linear):
    """``nn.Linear`` computing through :func:`linear` (same parameters and names), or
    through an MKL-packed copy of its weight once :meth:`pack` has run."""

    packed_weight: torch.Tensor | None = None

    @torch.no_grad()
    def pack(self) -> bool:
        """Pack the current weight for MKL (call again after changing the weight)."""
        self.packed_weight = None
        if not can_pack(self.weight):
            return False
        self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(
            self.weight.detach(), PACK_ROWS)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and x.dtype == torch.float32 and x.dim() == 2:
            return torch.ops.mkl._mkl_linear(x, self.packed_weight, self.weight, self.bias,
                                             PACK_ROWS)
        return linear(x, self.weight, self.bias)


def pack_linear_layers(model: nn.Module) -> int:
    """Pack every :class:`Linear` of ``model`` that can be packed; returns how many."""
    return sum(m.pack() for m in model.modules() if isinstance(m, Linear))
