"""The dtype of the LoRA slots on the CPU, chosen by measuring this machine.

The slots hold every loaded adapter's A and B, and a step reads all of them, so their
dtype sets both the bytes a decode step streams and which GEMM runs. In 16-bit, with
16-bit arithmetic (AVX512-BF16, AMX), the native GEMM reads half the bytes and ran a
prefill-sized LoRA product about 5x faster than widening to float32 (2-core AMD EPYC
with AVX512-BF16, benchmarks/lora_kernels.py); without it torch's 16-bit GEMM widens
tile by tile at a fraction of the float32 rate, and float32 slots win. Flags alone do
not say which: a short timing of both at a prefill run's shape does, once per process.
"""
from __future__ import annotations

import functools
import time

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)
# a prefill run of one adapter on SmolLM2's gate/up projection: rows, in, rank, out
_ROWS, _IN, _RANK, _OUT = 256, 576, 16, 1536
_WARMUP, _REPEATS = 3, 5


def lora_slot_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The slots' dtype: the model's on a GPU and for float32 models; on a CPU with a
    16-bit model, the faster of the model's dtype and float32 here."""
    if device.type != "cpu" or model_dtype not in HALF_DTYPES:
        return model_dtype
    return model_dtype if _native_is_faster(model_dtype) else torch.float32


@functools.cache
def _native_is_faster(dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, _IN, generator=gen).to(dtype)
    y = torch.zeros(_ROWS, _OUT, dtype=dtype)
    a32 = torch.randn(_IN, _RANK, generator=gen) / _IN ** 0.5
    b32 = torch.randn(_RANK, _OUT, generator=gen) / _RANK ** 0.5
    a16, b16 = a32.to(dtype), b32.to(dtype)

    def native():  # what kernels/lora_*.py do with 16-bit slots
        y.addmm_(x @ a16, b16)

    def widened():  # ... and with float32 slots
        y.add_((x.float() @ a32) @ b32)

    return _fastest(native, widened) == 0


def _fastest(*fns) -> int:
    """Index of the fastest of ``fns``: a few warm-up calls each (a 16-bit GEMM's first
    calls build its kernel), then interleaved rounds, best time of each."""
    for fn in fns:
        for _ in range(_WARMUP):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(_REPEATS):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best.index(min(best))
