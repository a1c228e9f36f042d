"""Which slice of a model one tensor-parallel rank holds, and cutting weights to it.

    attention   query heads split evenly: rank r holds heads [r*H/n, (r+1)*H/n)
                KV heads split evenly when n divides them; with fewer KV heads than
                ranks each KV head is replicated on n/KV ranks, and rank r holds KV head
                r // (n/KV), the one its query heads read (GQA groups stay whole)
    MLP         gate/up rows and down columns split evenly over the intermediate size
    vocabulary  ceil(V/n) rows per rank (the embedding and the LM head); the last rank's
                tail past V is zero padding that the gathered logits drop

q/k/v and gate/up are column-parallel (rows of [out, in] cut), o and down row-parallel
(columns cut; their partial sums meet in one all-reduce each).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from worker.models.architecture import ModelArchitecture

_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")


class ShardingError(ValueError):
    """The model cannot be split over this many ranks; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelShard:
    """Rank ``rank`` of ``size``: its heads, KV heads, MLP columns and vocabulary rows."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (replicated ones count once)
    first_head: int
    first_kv_head: int
    intermediate_size: int  # MLP columns on this rank
    vocab_size: int  # the model's whole vocabulary
    vocab_per_rank: int  # rows of the embedding / LM head on every rank (padded)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @classmethod
    def whole(cls, arch: ModelArchitecture) -> "ModelShard":
        """The unsplit model (no tensor parallelism)."""
        return cls.for_rank(arch, 0, 1)

    @classmethod
    def for_rank(cls, arch: ModelArchitecture, rank: int, size: int) -> "ModelShard":
        """Rank ``rank``'s slice; ShardingError when ``size`` does not split the model."""
        heads, kv = arch.num_attention_heads, arch.num_key_value_heads
        if heads % size or (kv % size and size % kv):
            raise ShardingError(
                f"parallel.tensor_parallel_size={size} cannot split this model: it must "
                f"divide the {heads} attention heads, and divide the {kv} KV heads or be "
                f"a multiple of them (sizes that work: {_valid_sizes(heads, kv)})")
        if arch.intermediate_size % size:
            raise ShardingError(
                f"parallel.tensor_parallel_size={size} must divide the MLP's intermediate "
                f"size {arch.intermediate_size}")
        first_head = rank * heads // size
        if kv >= size:
            num_kv, first_kv = kv // size, rank * kv // size
        else:  # replicated: size // kv ranks share each KV head
            num_kv, first_kv = 1, rank // (size // kv)
        return cls(rank, size, heads // size, num_kv, first_head, first_kv,
                   arch.intermediate_size // size, arch.vocab_size, -(-arch.vocab_size // size))

    def shard_state_dict(self, state_dict: dict[str, torch.Tensor], head_dim: int
                         ) -> dict[str, torch.Tensor]:
        """HF-named weights cut to this rank (views where no padding is needed, so a
        memory-mapped checkpoint is read only where this rank's slice lies)."""
        if self.size == 1:
            return state_dict
        return {name: self._cut(name, t, head_dim) for name, t in state_dict.items()}

    def _cut(self, name: str, t: torch.Tensor, head_dim: int) -> torch.Tensor:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._vocab_rows(t)
        m = _LAYER.match(name)
        if m is None:
            return t  # norms: whole on every rank
        proj = m.group(2)
        if proj == "q":
            return t.narrow(0, self.first_head * head_dim, self.num_heads * head_dim)
        if proj in ("k", "v"):
            return t.narrow(0, self.first_kv_head * head_dim, self.num_kv_heads * head_dim)
        if proj == "o":
            return t.narrow(1, self.first_head * head_dim, self.num_heads * head_dim)
        start = self.rank * self.intermediate_size
        if proj in ("gate", "up"):
            return t.narrow(0, start, self.intermediate_size)
        if proj == "down":
            return t.narrow(1, start, self.intermediate_size)
        raise ShardingError(f"no tensor-parallel rule for {name}")

    def _vocab_rows(self, t: torch.Tensor) -> torch.Tensor:
        start = self.vocab_start
        rows = t[start:start + self.vocab_per_rank]
        if rows.shape[0] == self.vocab_per_rank:
            return rows
        pad = t.new_zeros(self.vocab_per_rank - rows.shape[0], *t.shape[1:])
        return torch.cat([rows, pad])


def _valid_sizes(heads: int, kv: int) -> str:
    sizes = [n for n in range(1, heads + 1) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]
    return ", ".join(map(str, sizes))
