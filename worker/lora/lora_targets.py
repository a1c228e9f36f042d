"""Where PEFT's per-module LoRA weights land in Folio's fused projections.

PEFT adapts Hugging Face's separate q/k/v and gate/up projections; Folio fuses them
(worker/models/llama.py). Each fused projection is a LoRA target made of slices: a
slice's A rows feed its own block of the shrink output and its B writes its own
columns of the fused output::

    qkv_proj   shrink [ q: R | k: R | v: R ]  →  out [ q_size | kv_size | kv_size ]
    gate_up    shrink [ gate: R | up: R ]     →  out [ intermediate | intermediate ]
    o_proj, down_proj: one slice each

R is lora.max_lora_rank; an adapter of lower rank fills the first rows of each block
and leaves zeros, which add nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from worker.models.architecture import ModelArchitecture

PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
TARGET_OF = {module: target for target, modules in _FUSED.items() for module in modules}


@dataclass(frozen=True, slots=True)
class LoRASlice:
    """One PEFT module inside a fused target: its output columns."""

    module: str
    out_offset: int
    out_features: int


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One fused projection that LoRA adds to: its input width and output slices."""

    name: str
    in_features: int
    slices: tuple[LoRASlice, ...]

    @property
    def out_features(self) -> int:
        return sum(s.out_features for s in self.slices)

    @property
    def slice_widths(self) -> tuple[int, ...]:
        return tuple(s.out_features for s in self.slices)


def lora_targets(arch: ModelArchitecture) -> dict[str, LoRATarget]:
    """The four fused targets of a Llama-family layer, by name."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q_size = arch.num_attention_heads * arch.head_dim
    kv_size = arch.num_key_value_heads * arch.head_dim
    widths = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size),
              "v_proj": (hidden, kv_size), "o_proj": (q_size, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    targets = {}
    for name, modules in _FUSED.items():
        offset, slices = 0, []
        for module in modules:
            slices.append(LoRASlice(module, offset, widths[module][1]))
            offset += widths[module][1]
        targets[name] = LoRATarget(name, widths[modules[0]][0], tuple(slices))
    return targets


def module_shapes(arch: ModelArchitecture) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT module name."""
    return {s.module: (t.in_features, s.out_features)
            for t in lora_targets(arch).values() for s in t.slices}
