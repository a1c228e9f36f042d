"""Which model class serves which architecture name."""
from __future__ import annotations

from torch import nn

from worker.models.architecture import ModelArchitecture
from worker.models.llama import LlamaForCausalLM

# Every entry is a Llama-shaped decoder; differences (q/k/v bias, sliding window,
# rope scaling) are carried by ModelArchitecture fields.
_MODELS = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def build_model(arch: ModelArchitecture, max_positions: int, tp=None) -> nn.Module:
    """Instantiate the model class for ``arch.architecture``; ``tp`` (a TPGroup) builds
    this rank's slice of it (worker/distributed/model_shard.py)."""
    try:
        cls = _MODELS[arch.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch.architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None
    return cls(arch, max_positions, tp)
