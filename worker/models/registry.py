"""Which model class serves which architecture name."""
from __future__ import annotations

import contextlib
import threading

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


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_random_init():
    """nn.Linear and nn.Embedding without their random initialisation: the parameters
    stay ``torch.empty`` (pages the OS has not handed out yet) until the checkpoint is
    copied in. Every parameter is then loaded or replaced by a quantized layer (the
    model's load_weights refuses one left unloaded), so the init would only touch
    memory: the whole model in float32 at once, 4.7 GB for a 1.2B model whose Q4_1
    file is 0.7 GB."""
    with _INIT_LOCK:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _skip
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _skip(self) -> None:
    return None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def build_model(arch: ModelArchitecture, max_positions: int, tp=None) -> nn.Module:
    """Instantiate the model class for ``arch.architecture``, its parameters
    uninitialised (the caller loads every one); ``tp`` (a TPGroup) builds this rank's
    slice of it (worker/distributed/model_shard.py)."""
    try:
        cls = _MODELS[arch.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch.architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None
    with _no_random_init():
        return cls(arch, max_positions, tp)
