"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
read into memory, or refused with a message that names the problem.

Served: rank ``r``, ``lora_alpha``, ``use_rslora`` (scale alpha/sqrt(r) instead of
alpha/r) and target modules among q/k/v/o/gate/up/down (``lora_dropout`` only acts in
training). Refused: a pickled ``adapter_model.bin`` (never opened: unpickling runs
code), ``modules_to_save``, DoRA, a rank above ``lora.max_lora_rank``, tensors whose
shapes do not match the base model, unknown target modules, and the PEFT options that
change the arithmetic (trained biases, per-module ranks, fan_in_fan_out). Messages
name files by their name inside the folder, never by a full path. Files that are
symlinks leading out of the folder are refused too.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from worker.lora.lora_targets import PEFT_MODULES, module_shapes
from worker.models.architecture import ModelArchitecture

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter Folio cannot serve; the message says why (no full paths)."""


@dataclass(slots=True)
class LoRAAdapterWeights:
    """One adapter in host memory, float32: ``a[(layer, module)]`` is ``[r, in]``,
    ``b[(layer, module)]`` is ``[out, r]`` with the adapter's scale already folded in."""

    rank: int
    scaling: float
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.a)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def _inside(folder: Path, name: str) -> Path | None:
    """``folder/name`` if it exists and does not lead out of the folder."""
    path = folder / name
    if not path.exists():
        return None
    if not path.resolve().is_relative_to(folder.resolve()):
        raise LoRAAdapterError(f"{name} is a link that leads out of the adapter folder")
    return path


def read_adapter_config(folder: Path, max_rank: int) -> tuple[dict[str, Any], float]:
    """The checked ``adapter_config.json`` and the adapter's scale."""
    path = _inside(folder, CONFIG_FILE)
    if not folder.is_dir() or path is None:
        raise LoRAAdapterError(f"not a PEFT adapter folder: no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE} must hold a JSON object")
    _check_options(config)
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"rank {rank} exceeds lora.max_lora_rank ({max_rank})")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or \
            not math.isfinite(alpha):
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'lora_alpha' must be a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return config, float(scaling)


def _check_options(config: dict[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    if config.get("use_dora"):
        raise LoRAAdapterError("DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"modules_to_save is not supported (the adapter replaces "
                               f"whole modules: {config['modules_to_save']!r})")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"trained biases (bias={config['bias']!r}) are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAAdapterError("per-module ranks or alphas (rank_pattern, alpha_pattern) "
                               "are not supported")
    if config.get("fan_in_fan_out"):
        raise LoRAAdapterError("fan_in_fan_out adapters (Conv1D layers) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [] if targets == "all-linear" else [targets]
    unknown = sorted(set(targets or []) - set(PEFT_MODULES))
    if unknown:
        raise LoRAAdapterError(f"unknown target module {unknown[0]!r}: Folio adapts "
                               f"{', '.join(PEFT_MODULES)}")


def _weights_file(folder: Path) -> Path:
    path = _inside(folder, WEIGHTS_FILE)
    if path is not None:
        return path
    if _inside(folder, PICKLE_FILE) is not None:
        raise LoRAAdapterError(f"{PICKLE_FILE} holds pickled weights, which Folio never "
                               f"loads (unpickling runs code): save the adapter as "
                               f"{WEIGHTS_FILE} (save_pretrained's default)")
    raise LoRAAdapterError(f"no {WEIGHTS_FILE} in the adapter folder")


def _parse_key(key: str, num_layers: int) -> tuple[int, str, str]:
    if "lora_magnitude_vector" in key:
        raise LoRAAdapterError("DoRA adapters (lora_magnitude_vector) are not supported")
    if "modules_to_save" in key:
        raise LoRAAdapterError("modules_to_save is not supported")
    match = _KEY.match(key)
    if match is None or match.group(2) not in PEFT_MODULES:
        if ".lora_" in key:
            raise LoRAAdapterError(f"unknown target module {_module_of(key)!r}: Folio "
                                   f"adapts {', '.join(PEFT_MODULES)}")
        raise LoRAAdapterError(f"unknown target module {_module_of(key)!r}: the adapter "
                               f"holds its whole weights (modules_to_save is not "
                               f"supported); Folio adapts {', '.join(PEFT_MODULES)}")
    layer = int(match.group(1))
    if layer >= num_layers:
        raise LoRAAdapterError(f"the adapter has layer {layer}; the base model has "
                               f"{num_layers} layers")
    return layer, match.group(2), match.group(3)


_NOT_MODULES = {"base_model", "model", "layers", "self_attn", "mlp", "base_layer",
                "weight", "bias", "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"}


def _module_of(key: str) -> str:
    """The module a tensor name is about (``lm_head``, ``embed_tokens``...)."""
    parts = [p for p in key.split(".") if p not in _NOT_MODULES and not p.isdigit()]
    return (parts[0] if parts else key)[:80]


def load_peft_adapter(folder: str | Path, arch: ModelArchitecture,
                      max_rank: int) -> LoRAAdapterWeights:
    """Read, check and scale one adapter (LoRAAdapterError naming the problem)."""
    folder = Path(folder)
    config, scaling = read_adapter_config(folder, max_rank)
    rank, shapes = config["r"], module_shapes(arch)
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    try:
        with safe_open(_weights_file(folder), framework="pt") as f:
            for key in f.keys():
                layer, module, which = _parse_key(key, arch.num_hidden_layers)
                tensor = f.get_tensor(key).to(torch.float32)
                fan_in, fan_out = shapes[module]
                want = (rank, fan_in) if which == "A" else (fan_out, rank)
                if tuple(tensor.shape) != want:
                    raise LoRAAdapterError(
                        f"layer {layer} {module}.lora_{which} has shape {tuple(tensor.shape)}; "
                        f"rank {rank} on the base model needs {want}")
                (a if which == "A" else b)[(layer, module)] = tensor
    except SafetensorError as e:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} is not a readable safetensors file "
                               f"({e})") from None
    if not a or set(a) != set(b):
        raise LoRAAdapterError(f"{WEIGHTS_FILE} must hold lora_A and lora_B for every "
                               f"adapted module (found {len(a)} A and {len(b)} B)")
    return LoRAAdapterWeights(rank, scaling, a, {k: v * scaling for k, v in b.items()})
