"""Write new keys and values into their slots of the paged KV cache.

Cache layout per layer: ``kv_cache[0]`` holds keys and ``kv_cache[1]`` values, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A slot is
``block_id * block_size + offset``, so viewing a cache as ``[num_slots, heads, dim]``
turns the write into one indexed copy::

    key[t] : [num_kv_heads, head_dim]  ──▶  cache[0].view(num_slots, kvh, hd)[slot_mapping[t]]

A negative slot means "padding, write nothing" (CUDA-graph batches are padded with -1).
The cache may have another dtype than the keys (fp32 activations into an fp16 cache):
values are converted on the way in. An fp8 cache (memory.kv_cache_dtype) stores them
rounded to nearest even with scale 1.0, saturating at the format's largest value
(kernels/kv_quant.py); an int8 cache (CPU only) takes each head's row with its scale.
"""
from __future__ import annotations

import torch

from kernels.kv_quant import is_fp8, quantize_kv


def _index_copy(key, value, kv_cache, slot_mapping) -> None:
    num_blocks, block_size, num_kv_heads, row = kv_cache.shape[1:]  # row: head_dim (+ scale)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, row)
    key, value = quantize_kv(key, kv_cache.dtype), quantize_kv(value, kv_cache.dtype)
    if is_fp8(kv_cache.dtype):  # torch has no fp8 index_copy_ on the CPU: copy the bytes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor,
                                kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The spec: ``cache[slot_mapping[i]] = key[i]`` for every token i with a slot >= 0."""
    keep = slot_mapping >= 0
    _index_copy(key[keep], value[keep], kv_cache, slot_mapping[keep])


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache``.

    CUDA tensors take the Triton kernel. CPU batches are never padded (no CUDA graphs),
    so they skip the reference's padding filter and go straight to the indexed copy.
    """
    if kv_cache.is_cuda:  # Triton is loaded by the GPU path only
        from kernels.triton_reshape_and_cache import reshape_and_cache_triton
        reshape_and_cache_triton(key, value, kv_cache, slot_mapping)
    else:
        _index_copy(key, value, kv_cache, slot_mapping)
