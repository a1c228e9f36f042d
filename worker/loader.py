"""``load_model``: any supported model path → architecture + HF-layout state dict.

A path is a GGUF file (dequantised, cached on disk, see worker/weight_cache.py) or a
Hugging Face checkpoint folder (config.json + safetensors). ``"default"`` is the bundled
SmolLM2-135M-Instruct GGUF.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.gguf_loader import load_gguf
from worker.hf_loader import load_hf_checkpoint
from model_files.paths import ModelFileError, is_gguf_file, resolve_model_path
from worker.models.architecture import ModelArchitecture
from worker.weight_cache import WeightCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """A model's shape and weights, ready for the model code to copy into parameters."""

    architecture: ModelArchitecture
    state_dict: dict[str, torch.Tensor]  # HF Llama layout names, all in the requested dtype
    source_path: Path  # the resolved file or folder the weights came from
    load_seconds: float  # wall time of load_model, cache hits included


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its config name (float32/bfloat16/float16)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported weight dtype {dtype}; use one of {list(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype!r}; use one of {list(_DTYPES)} "
                         f"('auto' must be resolved for the device before loading)")
    return _DTYPES[dtype]


def load_model(path: str | Path, dtype: torch.dtype | str, *,
               use_cache: bool = True) -> LoadedModel:
    """Load a GGUF file or HF checkpoint folder; weights cast to ``dtype``.

    ``use_cache`` lets a GGUF's dequantised weights be read from / written to the disk
    cache (location from ``$FOLIO_CACHE_DIR``; ``off`` disables it everywhere).
    Raises ModelFileError for missing files or folders, GGUFFormatError for a corrupt
    GGUF, and UnsupportedModelError for architectures, tensors or quantisation types
    Folio cannot run.
    """
    started = time.perf_counter()
    torch_dtype = resolve_dtype(dtype)
    source = resolve_model_path(str(path))
    if source.is_dir():
        architecture, state_dict = load_hf_checkpoint(source, torch_dtype)
    elif is_gguf_file(source):
        cache = WeightCache.from_env() if use_cache else None
        architecture, state_dict = load_gguf(source, torch_dtype, cache)
    else:
        raise ModelFileError(f"{source} is neither a GGUF file nor a Hugging Face checkpoint "
                             f"folder")
    return LoadedModel(architecture, state_dict, source, time.perf_counter() - started)
