"""Write new keys and values into their slots of the paged KV cache.

Cache layout per layer: ``kv_cache[0]`` holds keys and ``kv_cache[1]`` values, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A slot is
``block_id * block_size + offset``, so viewing a cache as ``[num_slots, heads, dim]``
turns the write into one indexed copy.
"""
from __future__ import annotations

import torch


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor,
                                kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The spec: ``cache[slot_mapping[i]] = key[i]`` for every token i (keys and values)."""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache``."""
    reshape_and_cache_reference(key, value, kv_cache, slot_mapping)
