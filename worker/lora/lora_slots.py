"""The device slots: the A and B matrices of up to ``max_loras`` adapters, stacked per
layer and per fused target, which the LoRA kernels index by each token's slot.

Per layer and target (worker/lora/lora_targets.py), with S slots and rank R::

    a_store [S, in, slices * R]    logical a = a_store.transpose(1, 2): [S, slices*R, in]
    b_store [S, R, out]            logical b = b_store.transpose(1, 2): [S, out, R]

stored so that each slot's operand is a plain row-major matrix for the CPU GEMM
(kernels/lora_shrink.py). Filling a slot zeroes it first, so lower ranks and modules
the adapter does not adapt add exactly nothing.

Invariant: a slot in use by the current step is never refilled during it; a step
holds at most S distinct adapters (the scheduler's lora.max_loras), so ``activate``
always finds room by taking free slots, then the least recently used ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.lora.lora_targets import LoRATarget, lora_targets
from worker.lora.peft_adapter import LoRAAdapterWeights
from worker.models.architecture import ModelArchitecture


@dataclass(slots=True)
class TargetWeights:
    """The stacked weights of one target in one layer (see the module docstring)."""

    target: LoRATarget
    a: torch.Tensor  # [S, slices * R, in] view
    b: torch.Tensor  # [S, out, R] view


class LoRASlots:
    """Stacked adapter weights on the model's device, and which adapter fills each slot."""

    def __init__(self, arch: ModelArchitecture, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.targets = lora_targets(arch)
        self.layers: list[dict[str, TargetWeights]] = []
        for _ in range(arch.num_hidden_layers):
            layer = {}
            for name, t in self.targets.items():
                a = torch.zeros(num_slots, t.in_features, len(t.slices) * max_rank,
                                dtype=dtype, device=device)
                b = torch.zeros(num_slots, max_rank, t.out_features, dtype=dtype,
                                device=device)
                layer[name] = TargetWeights(t, a.transpose(1, 2), b.transpose(1, 2))
            self.layers.append(layer)
        self.slot_lora: list[int | None] = [None] * num_slots
        self.slot_targets: list[frozenset[str]] = [frozenset()] * num_slots
        self._last_used = [0] * num_slots
        self._clock = 0

    def activate(self, lora_ids: set[int],
                 weights_of: "dict[int, LoRAAdapterWeights]") -> dict[int, int]:
        """Slots for this step's adapters (filled from ``weights_of`` when new)."""
        if len(lora_ids) > self.num_slots:
            raise RuntimeError(f"{len(lora_ids)} adapters in one step, only "
                               f"{self.num_slots} slots (lora.max_loras)")
        self._clock += 1
        placed = {lid: s for s, lid in enumerate(self.slot_lora) if lid in lora_ids}
        for lora_id in sorted(lora_ids - placed.keys()):
            free = [s for s in range(self.num_slots)
                    if self.slot_lora[s] is None or self.slot_lora[s] not in lora_ids]
            slot = min(free, key=lambda s: (self.slot_lora[s] is not None,
                                            self._last_used[s]))
            self._fill(slot, lora_id, weights_of[lora_id])
            placed[lora_id] = slot
        for slot in placed.values():
            self._last_used[slot] = self._clock
        return placed

    def release(self, lora_id: int) -> None:
        """Forget an evicted adapter's slot (it is zeroed when next filled)."""
        for slot, lid in enumerate(self.slot_lora):
            if lid == lora_id:
                self.slot_lora[slot] = None
                self.slot_targets[slot] = frozenset()

    @torch.no_grad()
    def _fill(self, slot: int, lora_id: int, adapter: LoRAAdapterWeights) -> None:
        rank, max_rank = adapter.rank, self.max_rank
        touched = set()
        for layer_index, layer in enumerate(self.layers):
            for name, w in layer.items():
                w.a[slot].zero_()
                w.b[slot].zero_()
                for i, s in enumerate(w.target.slices):
                    a = adapter.a.get((layer_index, s.module))
                    if a is None:
                        continue
                    touched.add(name)
                    # logical a[slot, i*R : i*R + r, :] = A;  b[slot, cols, :r] = B
                    w.a[slot, i * max_rank:i * max_rank + rank].copy_(a)
                    w.b[slot, s.out_offset:s.out_offset + s.out_features, :rank].copy_(
                        adapter.b[(layer_index, s.module)])
        self.slot_lora[slot] = lora_id
        self.slot_targets[slot] = frozenset(touched)
