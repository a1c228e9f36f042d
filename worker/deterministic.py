"""Deterministic mode on the worker: batch-invariant linears and attention rows.

With ``worker.deterministic`` a request's logits are the same bits whatever else is in
its step, however its prompt is chunked and whether its prefix came from the cache:

- linear layers and the LM head compute each row independently of the row count
  (worker/models/linear.py, ``invariant_linear``);
- every query token is one decode row of the native CPU attention kernel, which walks
  its keys from position 0 in fixed chunks (worker/attention_backend.py);
- RMSNorm (native kernel, one row at a time), rotary, activations, the embedding and
  the sampler (per-row softmax, per-request seeded generators) already are.

Unsupported combinations are refused by the config (config/deterministic.py); what only
the worker knows (the resolved device, whether the native kernels built) is checked here.
"""
from __future__ import annotations

from dataclasses import replace

from worker.attention_backend import NATIVE_CPU, AttentionBackend


def make_deterministic(model, backend: AttentionBackend) -> AttentionBackend:
    """Switch ``model`` to its batch-invariant paths; returns the attention backend that
    gives every token its own decode row. Raises ValueError where that is impossible."""
    if backend.device.type != "cpu":
        raise ValueError(f"worker.deterministic: batch-invariant kernels exist for the CPU "
                         f"only, and worker.device resolved to {backend.device.type}")
    if backend.name != NATIVE_CPU:
        from kernels import cpu_extension
        raise ValueError("worker.deterministic needs the native CPU kernels, which did not "
                         f"load: {cpu_extension.unavailable_reason()}")
    model.make_batch_invariant()
    return replace(backend, per_token_rows=True)
