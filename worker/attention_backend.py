"""Which attention implementation a worker runs, decided once at start-up.

=============  ==========================================================================
torch          the reference everywhere (gather + SDPA); the spec, and the fallback
native-cpu     CPU: decodes through the C++ kernel (kernels/cpu_paged_attention.py),
               prefill chunks through the reference
triton         CUDA: the whole ragged batch in one Triton kernel per layer, with the batch
               described by device tensors (kernels/triton_paged_attention.py); on a CPU
               only under TRITON_INTERPRET=1 (tests)
=============  ==========================================================================

All three read an fp8 KV cache (memory.kv_cache_dtype); an int8 one only the torch
reference reads, so int8 runs on the CPU under auto (which then takes torch) or torch.
Deterministic mode (worker.deterministic) keeps native-cpu but sets ``per_token_rows``:
every query token, prefill or decode, becomes its own decode row for the native kernel,
which walks the row's keys from position 0 in fixed chunks of 64 in one fixed order.
A token's attention is then the same bits whether its prompt was computed in one chunk,
in many, or found in the prefix cache, and whatever else is in the step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from config.fields import ConfigError

TORCH, NATIVE_CPU, TRITON = "torch", "native-cpu", "triton"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The chosen backend and what building a batch for it needs."""

    name: str
    device: torch.device
    num_kv_heads: int = 0  # triton: the split-KV heuristic counts programs per KV head
    num_sms: int | None = None  # triton on CUDA: multiprocessors; None never splits KV
    per_token_rows: bool = False  # native-cpu, deterministic mode: one decode row a token
    native_prefill: bool = False  # native-cpu: fresh bf16 prompt segments on Folio's kernel
    decode_v_pass: str = "widened"  # native-cpu: the decode kernel's V pass (bf16 model
    #                                 and cache; worker/decode_v_pass.py)

    @property
    def is_triton(self) -> bool:
        return self.name == TRITON


def choose_attention_backend(configured: str, device: torch.device,
                             native_cpu_available=lambda: False) -> str:
    """``configured`` is worker.attention_backend (auto|torch|triton).

    auto: triton on CUDA, the native CPU kernel on a CPU where it builds, else torch.
    ``native_cpu_available`` is only called when its answer matters (it may compile).
    """
    if configured == TORCH:
        return TORCH
    if configured == TRITON:
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError("worker.attention_backend=triton on a CPU needs TRITON_INTERPRET=1 "
                             "(Triton's interpreter, for tests); use auto or torch")
        return TRITON
    if device.type == "cuda":
        return TRITON
    if device.type == "cpu" and native_cpu_available():
        return NATIVE_CPU
    return TORCH


def make_attention_backend(name: str, device: torch.device,
                           num_kv_heads: int) -> AttentionBackend:
    """The backend with its device facts (the multiprocessor count on CUDA)."""
    num_sms = None
    if name == TRITON and device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return AttentionBackend(name, device, num_kv_heads, num_sms)


def check_kv_cache_dtype(kv_cache_dtype: torch.dtype, configured: str,
                         device: torch.device) -> bool:
    """Refuse a KV cache dtype the configured backend cannot read; True for int8 (then
    the native CPU kernel must not be chosen either)."""
    if kv_cache_dtype != torch.int8:
        return False
    if device.type != "cpu" or configured == TRITON:
        raise ConfigError(
            f"memory.kv_cache_dtype=int8 is read by the torch attention backend on the CPU "
            f"only, not with worker.attention_backend={configured} on worker.device="
            f"{device.type}; use memory.kv_cache_dtype=fp8 there", "memory.kv_cache_dtype")
    return True
