"""Small PEFT LoRA adapters for tests, made by ``peft`` itself and saved with
``save_pretrained``: random non-zero A and B (``init_lora_weights=False``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """What to build: rank, alpha, targets, rsLoRA, and the seed of its weights."""

    rank: int = 8
    alpha: float = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    use_rslora: bool = False
    seed: int = 0
    scale: float = 1.0  # multiplies the random B (tiny models need a visible effect)


def load_base(base: Path, gguf_file: str | None = None):
    """The base model in float32 through transformers (a folder, or a GGUF in it)."""
    import torch
    from transformers import AutoModelForCausalLM
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **kw).eval()


def make_adapter(base_model, out: Path, spec: AdapterSpec) -> Path:
    """Wrap ``base_model`` (left unchanged) in a fresh LoRA, save it to ``out``."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(spec.seed)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        init_lora_weights=False, use_rslora=spec.use_rslora,
                        lora_dropout=0.1)
    model = get_peft_model(copy.deepcopy(base_model), config)
    if spec.scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(spec.scale)
    model.save_pretrained(out)
    return out


def edit_config(folder: Path, **changes) -> Path:
    """Rewrite keys of a saved adapter's adapter_config.json (None deletes a key)."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder
