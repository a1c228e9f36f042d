"""SwiGLU's activation: ``SiLU(gate) * up`` for a fused gate/up projection's output.

``gate_up`` is ``[T, 2 * intermediate]``, the gate's columns first. The spec is torch's
two ops, ``F.silu(gate) * up`` in the activation dtype (each rounds once). On the CPU
the native kernel (``csrc/silu_and_mul.cpp``) makes one pass with the same exponential
torch's vectorised SiLU calls, so its bits are the reference's; elsewhere the reference
runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The spec."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up``: the native kernel for a 2-D CPU tensor with contiguous rows
    when it is built, else the reference."""
    if (gate_up.device.type == "cpu" and gate_up.dim() == 2 and gate_up.stride(-1) == 1
            and gate_up.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and cpu_extension.is_available()):
        return cpu_extension.require().silu_and_mul(gate_up)
    return silu_and_mul_reference(gate_up)
