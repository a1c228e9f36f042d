"""Device and dtype choices for the worker."""
from __future__ import annotations

from functools import lru_cache

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(f.read().split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def cpu_has_native_fp16() -> bool:
    """True when the CPU multiplies float16 in hardware (AVX512-FP16 or AMX-FP16)."""
    return bool({"avx512_fp16", "amx_fp16"} & _cpu_flags())


def cpu_has_native_half(dtype: torch.dtype) -> bool:
    """Whether the CPU has arithmetic for this 16-bit float type."""
    return cpu_has_native_bf16() if dtype == torch.bfloat16 else cpu_has_native_fp16()


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("worker.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on GPUs and on CPUs with bf16 hardware, float32 otherwise.

    Without bf16 instructions torch's CPU matmul converts every bf16 operand to float32
    inside the kernel and measured here at half the float32 speed or worse. Folio's
    native kernel (worker/models/linear.py) closes that gap for decode, but bf16 prefill
    still runs the float32 GEMM on widened weights, so float32 stays the default there.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32
