"""Which settings deterministic mode (``worker.deterministic``) cannot be combined with.

Deterministic mode makes each request's tokens and logprobs independent of its batch
(README, "Deterministic mode") by routing the CPU model through batch-invariant paths.
The features below have kernels or batch shapes of their own that were not made
invariant, so the combination is refused at start-up, naming both keys, rather than
served with a guarantee it does not keep:

- LoRA: the adapter kernels group rows by adapter (their sums depend on the mix);
- speculative decoding: the draft model and the verify batch are other forward shapes;
- tensor parallelism: partial sums meet in all-reduces whose order is the backend's;
- CUDA, and the torch/triton attention backends: only the native CPU kernels have
  batch-invariant paths (the device itself is resolved, and checked, by the worker);
- quantized weights (model.quantization): their kernels are chosen per row count;
- the int8 KV cache: only the torch attention path reads it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from config.fields import ConfigError

if TYPE_CHECKING:
    from config.schema import FolioConfig

KEY = "worker.deterministic"


def deterministic_conflicts(config: FolioConfig) -> list[tuple[str, str]]:
    """(key, why) for each setting that deterministic mode cannot serve."""
    if not config.worker.deterministic:
        return []
    conflicts = []
    if config.lora.enable_lora:
        conflicts.append(("lora.enable_lora", "the LoRA kernels are not batch-invariant"))
    if config.speculative.is_enabled:
        conflicts.append(("speculative.method",
                          f"speculative decoding ({config.speculative.method}) is not "
                          "batch-invariant"))
    if config.parallel.is_enabled:
        conflicts.append(("parallel.tensor_parallel_size",
                          "tensor-parallel all-reduces are not batch-invariant"))
    if config.worker.device == "cuda":
        conflicts.append(("worker.device", "only the CPU has batch-invariant kernels"))
    if config.model.quantization != "none":
        conflicts.append(("model.quantization",
                          f"{config.model.quantization!r}: quantized weights run kernels "
                          "chosen per row count (keep none)"))
    if config.memory.kv_cache_dtype == "int8":
        conflicts.append(("memory.kv_cache_dtype",
                          "the int8 KV cache is read only by the torch attention path"))
    if config.worker.attention_backend != "auto":
        conflicts.append(("worker.attention_backend",
                          f"{config.worker.attention_backend!r}: deterministic mode runs "
                          "the native CPU attention kernel (keep auto)"))
    return conflicts


def check_deterministic_supported(config: FolioConfig) -> None:
    """Raise a ConfigError naming ``worker.deterministic`` and the first conflicting key."""
    conflicts = deterministic_conflicts(config)
    if conflicts:
        key, why = conflicts[0]
        raise ConfigError(f"{KEY}: true cannot be combined with {key} ({why}); turn one of "
                          "them off", key)
