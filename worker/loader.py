"""``load_model``: any supported model path → architecture + HF-layout state dict.

A path is a GGUF file (dequantised, cached on disk, see worker/weight_cache.py; or with
its Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices kept as blocks) or a Hugging Face checkpoint folder
(config.json + safetensors). ``"default"`` is the bundled SmolLM2-135M-Instruct GGUF.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_files.gguf_file import GGUFFile
from worker.gguf_loader import KEPT_QUANTIZED_NAMES, KEPT_QUANTIZED_TYPES, QuantizedBlocks
from worker.gguf_loader import load_gguf, load_gguf_quantized
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
    quantization: str = "none"  # as resolved: none, int8 (to apply) or gguf (blocks kept)
    # HF name -> blocks of matrices kept quantized (the rest is in state_dict)
    quantized: dict[str, QuantizedBlocks] = field(default_factory=dict)


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


def resolve_quantization(quantization: str, source: Path, gguf: GGUFFile | None) -> str:
    """``auto`` → ``gguf`` for a GGUF holding matrices in KEPT_QUANTIZED_TYPES, else ``none``;
    ``gguf`` on anything but such a file is an error."""
    has_blocks = gguf is not None and any(
        t.ggml_type in KEPT_QUANTIZED_TYPES and len(t.shape) == 2 for t in gguf.tensors.values())
    if quantization == "auto":
        return "gguf" if has_blocks else "none"
    if quantization == "gguf" and not has_blocks:
        raise ValueError(f"model.quantization=gguf needs a GGUF with {KEPT_QUANTIZED_NAMES} "
                         f"matrices; {source} has none")
    return quantization


def load_model(path: str | Path, dtype: torch.dtype | str, *,
               use_cache: bool = True, quantization: str = "none") -> LoadedModel:
    """Load a GGUF file or HF checkpoint folder; weights cast to ``dtype``.

    ``use_cache`` lets a GGUF's dequantised weights be read from / written to the disk
    cache (location from ``$FOLIO_CACHE_DIR``; ``off`` disables it everywhere).
    ``quantization`` (model.quantization, see :func:`resolve_quantization`): with
    ``gguf`` the kernels' formats stay as blocks in ``LoadedModel.quantized``; ``int8``
    loads floats for the model to quantize.
    Raises ModelFileError for missing files or folders, GGUFFormatError for a corrupt
    GGUF, and UnsupportedModelError for architectures, tensors or quantisation types
    Folio cannot run.
    """
    started = time.perf_counter()
    torch_dtype = resolve_dtype(dtype)
    source = resolve_model_path(str(path))
    gguf = GGUFFile(source) if not source.is_dir() and is_gguf_file(source) else None
    quantization = resolve_quantization(quantization, source, gguf)
    quantized = {}
    if quantization == "gguf":
        architecture, state_dict, quantized = load_gguf_quantized(gguf, torch_dtype)
    elif source.is_dir():
        architecture, state_dict = load_hf_checkpoint(source, torch_dtype)
    elif is_gguf_file(source):
        cache = WeightCache.from_env() if use_cache else None
        architecture, state_dict = load_gguf(gguf, torch_dtype, cache)
    else:
        raise ModelFileError(f"{source} is neither a GGUF file nor a Hugging Face checkpoint "
                             f"folder")
    return LoadedModel(architecture, state_dict, source, time.perf_counter() - started,
                       quantization, quantized)
