"""A Hugging Face checkpoint folder (config.json + *.safetensors) as architecture + weights.

Reads both config dialects: transformers 4 (``rope_theta`` + ``rope_scaling``) and
transformers 5 (``rope_parameters`` holding the theta and the scaling together).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model_files.paths import ModelFileError, UnsupportedModelError
from worker.models.architecture import ModelArchitecture, RopeScaling
from worker.weight_names import validate_state_dict

# config.json `architectures[0]` → ModelArchitecture.architecture
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some exporters save next to the weights; the model recomputes them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path} is not valid JSON: {exc}") from exc


def architecture_from_hf_config(folder: Path) -> ModelArchitecture:
    """Build the ModelArchitecture from ``config.json`` (+ ``generation_config.json``)."""
    config = _read_json(folder / "config.json")
    names = config.get("architectures") or []
    kind = SUPPORTED_HF_ARCHITECTURES.get(names[0]) if names else None
    if kind is None:
        raise UnsupportedModelError(
            f"{folder}: architecture {names or config.get('model_type')!r} is not supported; "
            f"Folio runs {sorted(SUPPORTED_HF_ARCHITECTURES)}")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
        raise UnsupportedModelError(f"{folder}: only SiLU-gated MLPs without bias are supported")
    hidden_size = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    rope_theta, rope_scaling = _rope(config, folder)
    return ModelArchitecture(
        architecture=kind,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        max_position_embeddings=int(config["max_position_embeddings"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=kind == "qwen2" or bool(config.get("attention_bias", False)),
        sliding_window=_sliding_window(kind, config, folder),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(folder, config),
    )


def _rope(config: dict[str, Any], folder: Path) -> tuple[float, RopeScaling | None]:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"{folder}: rope scaling {rope_type!r} is not supported "
                                    f"(only 'llama3' is)")
    return theta, RopeScaling(
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _sliding_window(kind: str, config: dict[str, Any], folder: Path) -> int | None:
    window = config.get("sliding_window")
    if kind == "mistral":
        return int(window) if window else None
    if kind != "qwen2" or not config.get("use_sliding_window") or not window:
        return None
    # Qwen2 slides only in layers >= max_window_layers; Folio needs one rule for all layers.
    num_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= int(config.get("max_window_layers", 0)) else "full_attention"
        for i in range(num_layers)]
    if all(t == "full_attention" for t in layer_types):
        return None
    if all(t == "sliding_attention" for t in layer_types):
        return int(window)
    raise UnsupportedModelError(f"{folder}: sliding window in only some layers is not supported")


def _eos_token_ids(folder: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """generation_config.json's eos ids when present (they include end-of-turn tokens)."""
    generation = folder / "generation_config.json"
    value = config.get("eos_token_id")
    if generation.is_file():
        value = _read_json(generation).get("eos_token_id", value)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(int(v) for v in values))


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: the sharded index's files, or every ``*.safetensors`` in the folder."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder}: no *.safetensors weights found (PyTorch .bin "
                             f"checkpoints are not supported; convert them to safetensors)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFileError(f"{folder}: weight shards listed in {SAFETENSORS_INDEX} are "
                             f"missing: {missing}")
    return files


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except SafetensorError as e:  # truncated, garbage, a bad header
        raise ModelFileError(f"{file}: not a readable safetensors file ({e}); the "
                             f"checkpoint is corrupt or incomplete: copy or export it "
                             f"again") from None


def load_hf_state_dict(folder: Path, architecture: ModelArchitecture,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All weights of the folder, cast to ``dtype``; lm_head dropped when embeddings are tied."""
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        for name, tensor in read_safetensors(file).items():
            if name.endswith(IGNORED_SUFFIXES):
                continue
            state_dict[name] = tensor.to(dtype)
    if architecture.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    validate_state_dict(state_dict, architecture, folder)
    return state_dict


def load_hf_checkpoint(folder: Path,
                       dtype: torch.dtype) -> tuple[ModelArchitecture, dict[str, torch.Tensor]]:
    """Architecture and state dict of a Hugging Face checkpoint folder."""
    architecture = architecture_from_hf_config(folder)
    return architecture, load_hf_state_dict(folder, architecture, dtype)
