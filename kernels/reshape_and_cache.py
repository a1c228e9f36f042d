"""Write new keys and values into their slots of the paged KV cache.

Cache layout per layer: ``kv_cache[0]`` holds keys and ``kv_cache[1]`` values, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A slot is
``block_id * block_size + offset``, so viewing a cache as ``[num_slots, heads, dim]``
turns the write into one indexed copy::

    key[t] : [num_kv_heads, head_dim]  ──▶  cache[0].view(num_slots, kvh, hd)[slot_mapping[t]]

A negative slot means "padding, write nothing" (CUDA-graph batches are padded with -1).
The cache may have another dtype than the keys (fp32 activations into an fp16 cache):
values are converted on the way in.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _index_copy(key, value, kv_cache, slot_mapping) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor,
                                kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The spec: ``cache[slot_mapping[i]] = key[i]`` for every token i with a slot >= 0."""
    keep = slot_mapping >= 0
    _index_copy(key[keep], value[keep], kv_cache, slot_mapping[keep])


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              stride_key_token, stride_value_token,
                              ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token: its ROW = num_kv_heads * head_dim contiguous elements.
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < tl.where(slot >= 0, ROW, 0)  # a padding token (slot -1) writes nothing
    k = tl.load(key_ptr + token * stride_key_token + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    # The kernel needs each token's [heads, dim] contiguous; the token stride is free
    # (keys are usually a column slice of the fused qkv output).
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """The Triton kernel (also runs on CPU tensors under ``TRITON_INTERPRET=1``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert kv_cache.is_contiguous(), "the kernel addresses the cache as [slots, kvh*hd]"
    key, value = _token_rows(key), _token_rows(value)
    row = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), value.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache``.

    CUDA tensors take the Triton kernel. CPU batches are never padded (no CUDA graphs),
    so they skip the reference's padding filter and go straight to the indexed copy.
    """
    if kv_cache.is_cuda:
        reshape_and_cache_triton(key, value, kv_cache, slot_mapping)
    else:
        _index_copy(key, value, kv_cache, slot_mapping)
