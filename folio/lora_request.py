"""``LoRARequest``: which adapter an offline prompt runs with (vLLM's shape)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA adapter by name, a positive integer id unique to it, and its folder.

    ``LLM.generate(..., lora_request=...)`` takes one for every prompt or a list with one
    per prompt (None: the base model). The first use checks and registers the adapter;
    later uses must give the same id and folder for the name.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
