"""The paged KV cache: one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``.

Its dtype is the model's (memory.kv_cache_dtype: auto) or a one-byte fp8 format, which
halves a block's bytes against bfloat16: the same budget holds twice the tokens. An
int8 cache adds each head row's scale as two more bytes (kernels/kv_quant.py), so its
last dim is ``head_dim + 2``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_quant import row_width
from worker.models.architecture import ModelArchitecture


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """memory.kv_cache_dtype as a torch dtype: ``auto`` is the model's own."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Sizes that fix how many bytes one block takes across all layers."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, arch: ModelArchitecture, block_size: int, dtype: torch.dtype,
                  num_kv_heads: int | None = None):
        """``num_kv_heads``: this rank's KV heads under tensor parallelism (the cache is
        sharded by KV head); None: all of the model's."""
        return cls(arch.num_hidden_layers, block_size, num_kv_heads or arch.num_key_value_heads,
                   arch.head_dim, dtype)

    @property
    def row_width(self) -> int:
        """Elements of one head's row: head_dim, plus an int8 cache's scale bytes."""
        return row_width(self.head_dim, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_width * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int,
                      device: torch.device) -> list[torch.Tensor]:
    """Zero-filled caches (masked-out positions must never hold NaN garbage)."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


def copy_blocks(kv_caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Copy whole blocks (every layer, keys and values) — copy-on-write for forks."""
    if not src:
        return
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    for cache in kv_caches:
        cache[:, dst_t] = cache[:, src_t]
