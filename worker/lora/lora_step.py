"""One step's LoRA work, passed down the model explicitly (like the attention context).

``LlamaForCausalLM.forward(..., lora=step)`` hands ``step.layer(i)`` to layer i, whose
projections call ``layer.add(target, x, y)`` right after computing ``y = x @ W.T``::

    y[:, slice cols] += lora_expand(lora_shrink(x, A[slot]), B[slot])   per slice

or, for a decode-sized step on the CPU, the same sums in one native call per projection
(kernels/csrc/lora_decode.cpp; batched GEMMs over the step's slots without it,
kernels/lora_slot_batch.py).

A step without adapter rows gets no LoRAStep at all (the model runs as without LoRA);
a target that no adapter of the step adapts is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora_expand import lora_expand
from kernels.lora_mapping import LoRAMapping
from kernels.lora_shrink import lora_shrink
from kernels.lora_slot_batch import lora_add_decode
from worker.lora.lora_slots import LoRASlots


@dataclass(slots=True)
class LoRALayer:
    """The step's LoRA work in one decoder layer."""

    step: "LoRAStep"
    index: int

    def add(self, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the LoRA delta of ``target`` (a fused projection) to its output ``y``."""
        step = self.step
        if target not in step.active_targets:
            return
        w = step.slots.layers[self.index][target]
        rank = step.slots.max_rank
        mapping = step.mapping
        if mapping.slot_batch is not None:  # a decode-sized step on the CPU
            lora_add_decode(y, x, w.a, w.b, w.target.slice_widths, rank,
                            mapping.token_slots, mapping.slot_batch)
            return
        xa = lora_shrink(x, w.a, step.mapping)
        for i, s in enumerate(w.target.slices):
            cols = slice(s.out_offset, s.out_offset + s.out_features)
            lora_expand(y[:, cols], xa[:, i * rank:(i + 1) * rank], w.b[:, cols],
                        step.mapping)


@dataclass(slots=True)
class LoRAStep:
    """The token → slot mapping of one step and the slots it reads."""

    mapping: LoRAMapping
    slots: LoRASlots
    active_targets: frozenset[str]  # targets adapted by at least one adapter of the step

    def layer(self, index: int) -> LoRALayer:
        return LoRALayer(self, index)
