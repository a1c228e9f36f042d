"""Weights of a GGUF file as a Hugging Face Llama-layout state dict of torch tensors.

Three translations happen per tensor:

1. bytes → float32: ``gguf.quants.dequantize`` (F16/BF16 are widened directly);
2. GGUF name → HF name (``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``);
3. for ``llama`` GGUFs only, q/k rows go back to HF's rotary layout (see
   :func:`unpermute_rope_rows`). Qwen2 GGUFs keep HF's layout, so nothing is undone there.

:func:`load_gguf_quantized` skips step 1 for matrices in a format the native kernels
compute on (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K): their blocks stay as stored (rows permuted as in step 3,
which moves whole rows of blocks), for kernels/quant_linear.py to pack.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from observability.logging import get_logger
from worker.gguf_architecture import ROPE_FREQS_TENSOR, architecture_from_gguf
from model_files.gguf_file import GGUFFile
from model_files.paths import UnsupportedModelError
from worker.models.architecture import ModelArchitecture
from worker.weight_cache import WeightCache
from worker.weight_names import validate_state_dict

log = get_logger(__name__)

# Types this loader turns into floats. The K-quants go through the same gguf.quants code.
SUPPORTED_GGML_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
})

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Formats kept quantized by load_gguf_quantized (the native kernels' formats).
KEPT_QUANTIZED_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                                  GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                                  GGMLQuantizationType.Q6_K})
KEPT_QUANTIZED_NAMES = "/".join(sorted(t.name for t in KEPT_QUANTIZED_TYPES))
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors the architecture already accounts for: rope_freqs became rope_scaling.
_FOLDED_INTO_ARCHITECTURE = frozenset({ROPE_FREQS_TENSOR})


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama-layout name of a GGUF tensor; UnsupportedModelError if unknown."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_PARTS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_PARTS[part]}.{kind}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family "
                                f"model; this GGUF's architecture is not supported")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a llama q_proj/k_proj weight (or bias).

    HF's rotary embedding rotates row ``i`` of a head with row ``i + d/2`` (rotate_half);
    llama.cpp rotates adjacent rows ``2i, 2i+1``, so its converter interleaves the halves::

        HF rows of one head:    x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)
        GGUF rows of one head:  x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)

    Reading the GGUF rows as (head, d/2, 2) and swapping the last two axes restores HF's.
    """
    rows = weight.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise UnsupportedModelError(f"cannot split {rows} rows into {num_heads} rotary heads")
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def dequantize_tensor(gguf: GGUFFile, name: str) -> torch.Tensor:
    """One GGUF tensor as a float32 (or bf16/f16, as stored) torch tensor in numpy order."""
    info = gguf.tensors[name]
    if info.ggml_type not in SUPPORTED_GGML_TYPES:
        supported = sorted(t.name for t in SUPPORTED_GGML_TYPES)
        raise UnsupportedModelError(f"{gguf.path}: tensor {name!r} is {info.ggml_type.name}; "
                                    f"supported GGUF tensor types are {supported}")
    raw = gguf.raw_tensor(name)
    if info.ggml_type == GGMLQuantizationType.BF16:
        # bf16 is the top half of a float32: reinterpret the bytes, no arithmetic needed.
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(info.shape)
    if info.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(raw.copy())
    return torch.from_numpy(dequantize(raw, info.ggml_type))


@dataclass(slots=True)
class QuantizedBlocks:
    """A GGUF matrix kept as stored: ``raw`` uint8 ``[rows, bytes per row]`` of
    ``ggml_type`` blocks; ``shape`` is the ``(rows, columns)`` of the values they hold."""

    ggml_type: int
    shape: tuple[int, int]
    raw: torch.Tensor


def _hf_rows(tensor: torch.Tensor, hf_name: str, architecture: ModelArchitecture) -> torch.Tensor:
    """Rows in HF order: llama q/k rows un-permuted (any trailing layout, bytes too)."""
    if architecture.architecture == "llama":
        if ".self_attn.q_proj." in hf_name:
            tensor = unpermute_rope_rows(tensor, architecture.num_attention_heads)
        elif ".self_attn.k_proj." in hf_name:
            tensor = unpermute_rope_rows(tensor, architecture.num_key_value_heads)
    return tensor


def _convert_tensor(gguf: GGUFFile, name: str, architecture: ModelArchitecture,
                    dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    hf_name = hf_tensor_name(name)
    tensor = _hf_rows(dequantize_tensor(gguf, name), hf_name, architecture)
    return hf_name, tensor.to(dtype).contiguous()


def _keeps_blocks(gguf: GGUFFile, name: str) -> bool:
    info = gguf.tensors[name]
    return (info.ggml_type in KEPT_QUANTIZED_TYPES and len(info.shape) == 2
            and name.endswith(".weight") and "norm" not in name)


def load_gguf_quantized(gguf: GGUFFile, dtype: torch.dtype) -> tuple[
        ModelArchitecture, dict[str, torch.Tensor], dict[str, QuantizedBlocks]]:
    """Architecture, the dequantised tensors (norms, other formats) in ``dtype``, and
    the matrices in KEPT_QUANTIZED_TYPES as their blocks, all under HF names."""
    architecture = architecture_from_gguf(gguf)
    state_dict, quantized = {}, {}
    for name in gguf.tensors:
        if name in _FOLDED_INTO_ARCHITECTURE:
            continue
        if not _keeps_blocks(gguf, name):
            hf_name, state_dict[hf_name] = _convert_tensor(gguf, name, architecture, dtype)
            continue
        info, hf_name = gguf.tensors[name], hf_tensor_name(name)
        with warnings.catch_warnings():  # read-only view of the mapped file: never written
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(gguf.raw_tensor(name))
        quantized[hf_name] = QuantizedBlocks(int(info.ggml_type), info.shape,
                                             _hf_rows(raw, hf_name, architecture))
    validate_state_dict({**state_dict, **quantized}, architecture, gguf.path)
    return architecture, state_dict, quantized


def load_gguf_state_dict(gguf: GGUFFile, architecture: ModelArchitecture,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantise every weight tensor of ``gguf`` into HF names and ``dtype``.

    Sequential on purpose: gguf.quants works in 16-row numpy slices that hold the GIL for
    most of their time, and a thread pool measured no faster on two cores.
    """
    state_dict = dict(_convert_tensor(gguf, name, architecture, dtype)
                      for name in gguf.tensors if name not in _FOLDED_INTO_ARCHITECTURE)
    validate_state_dict(state_dict, architecture, gguf.path)
    return state_dict


def load_gguf(source: Path | GGUFFile, dtype: torch.dtype,
              cache: WeightCache | None = None) -> tuple[ModelArchitecture, dict[str, torch.Tensor]]:
    """Architecture and HF-layout state dict of a GGUF file (or its parsed header), via
    ``cache`` when given.

    The header is always parsed (about 0.25 s for SmolLM2) so a cache entry can never
    disagree with the architecture; only the dequantised tensors come from the cache.
    """
    gguf = source if isinstance(source, GGUFFile) else GGUFFile(source)
    path = gguf.path
    architecture = architecture_from_gguf(gguf)
    cached = cache.load(path, dtype) if cache is not None else None
    if cached is not None:
        try:
            validate_state_dict(cached, architecture, path)
            return architecture, cached
        except UnsupportedModelError as exc:  # an entry from another converter version
            log.warning("weight cache entry ignored", path=str(path), reason=str(exc))
    state_dict = load_gguf_state_dict(gguf, architecture, dtype)
    if cache is not None:
        cache.store(path, dtype, state_dict)
    return architecture, state_dict
