"""The ``lora`` section: serving PEFT LoRA adapters over the base model (see README, LoRA).

Its own module because config/schema.py is full; schema.py imports it into the tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from config.fields import _check, _f

ADAPTER_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class LoRAAdapterConfig:
    """One adapter served from start-up (vLLM's ``--lora-modules name=path``)."""

    name: str = _f("", "the name clients pass as 'model' to use this adapter")
    path: str = _f("", "the PEFT adapter folder (adapter_config.json + "
                   "adapter_model.safetensors)")

    def __post_init__(self):
        _check(0 < len(self.name) <= ADAPTER_NAME_CHARS, "lora.adapters",
               f"every adapter needs a name of 1-{ADAPTER_NAME_CHARS} characters")
        _check(bool(self.path), "lora.adapters", f"adapter {self.name!r} needs a path")

    @classmethod
    def parse(cls, text: str) -> "LoRAAdapterConfig":
        """``name=path`` (how --set and the environment write an adapter)."""
        name, sep, path = text.partition("=")
        _check(bool(sep), "lora.adapters", f"expected name=path, got {text!r}")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA: many fine-tunes of the base model served side by side in one batch."""

    enable_lora: bool = _f(False, "serve LoRA adapters (allocates lora.max_loras device "
                           "slots of lora.max_lora_rank)")
    max_loras: int = _f(4, "most distinct adapters in one step (device slots); requests "
                        "of further adapters wait for a slot")
    max_lora_rank: int = _f(16, "highest adapter rank served (slots are this wide); a "
                            "higher-rank adapter is refused")
    max_cpu_loras: int = _f(8, "adapters kept loaded in host memory (LRU, in-use ones are "
                            "never evicted); at least max_loras")
    adapters: tuple[LoRAAdapterConfig, ...] = field(default=(), metadata={
        "doc": "adapters served from start-up: a list of {name, path} (or name=path,... "
               "with --set); each is checked when the worker starts"})
    allow_runtime_updates: bool = _f(False, "serve POST /v1/load_lora_adapter and "
                                     "/v1/unload_lora_adapter (behind the API key)")
    allowed_paths: tuple[str, ...] = _f((), "folders that runtime-loaded adapters must "
                                        "lie in (after resolving .. and symlinks); none: "
                                        "every runtime load is refused")

    def __post_init__(self):
        _check(1 <= self.max_loras <= 256, "lora.max_loras", "must be in 1..256")
        _check(1 <= self.max_lora_rank <= 512, "lora.max_lora_rank", "must be in 1..512")
        _check(self.max_cpu_loras >= self.max_loras, "lora.max_cpu_loras",
               f"must be at least lora.max_loras ({self.max_loras})")
        names = [a.name for a in self.adapters]
        _check(len(names) == len(set(names)), "lora.adapters", "adapter names must differ")
