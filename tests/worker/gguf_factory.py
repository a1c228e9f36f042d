"""Tiny GGUF files written with gguf.GGUFWriter, and the HF-layout weights they encode.

The expected weights are built in Hugging Face's layout first; the file then gets what
llama.cpp's converter would write: GGUF names, q/k rows permuted for llama (not qwen2),
and each tensor quantised to the requested type. Because quantisation works within a
row and the permutation only moves whole rows, the expected value of every tensor is
simply ``dequantize(quantize(x))`` in HF order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (the forward direction)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@dataclass
class TinyModelSpec:
    """Shape and storage choices of a tiny test model."""

    arch: str = "llama"
    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tied: bool = True
    embed_type: Q = Q.Q8_0
    proj_type: Q = Q.F16
    norm_type: Q = Q.F32
    weight_scale: float = 1.0  # matrices are standard normal times this
    extra_metadata: dict[str, Any] = field(default_factory=dict)
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)  # stored as F32


def _roundtrip(values: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to store, float32 values a reader must get back)."""
    stored = quantize(values, qtype)
    if qtype in (Q.F32, Q.F16):
        return stored, stored.astype(np.float32)
    return stored, dequantize(stored, qtype)


def _hf_tensors(spec: TinyModelSpec, rng: np.random.Generator) -> list[tuple[str, str, np.ndarray, Q]]:
    """(gguf name, hf name, float32 values in HF layout, storage type) for every tensor."""
    head_dim = spec.hidden_size // spec.num_heads
    h, i, q_rows, kv_rows = (spec.hidden_size, spec.intermediate_size,
                             spec.num_heads * head_dim, spec.num_kv_heads * head_dim)
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    if spec.weight_scale != 1.0:
        unit = rand
        rand = lambda *shape: unit(*shape) * (spec.weight_scale if len(shape) == 2 else 1)  # noqa: E731
    out = [("token_embd.weight", "model.embed_tokens.weight", rand(spec.vocab_size, h), spec.embed_type),
           ("output_norm.weight", "model.norm.weight", rand(h), spec.norm_type)]
    if not spec.tied:
        out.append(("output.weight", "lm_head.weight", rand(spec.vocab_size, h), spec.proj_type))
    parts = [("attn_q", "self_attn.q_proj", (q_rows, h)), ("attn_k", "self_attn.k_proj", (kv_rows, h)),
             ("attn_v", "self_attn.v_proj", (kv_rows, h)), ("attn_output", "self_attn.o_proj", (h, q_rows)),
             ("ffn_gate", "mlp.gate_proj", (i, h)), ("ffn_up", "mlp.up_proj", (i, h)),
             ("ffn_down", "mlp.down_proj", (h, i))]
    for layer in range(spec.num_layers):
        g, f = f"blk.{layer}", f"model.layers.{layer}"
        out += [(f"{g}.{a}.weight", f"{f}.{b}.weight", rand(*shape), spec.proj_type)
                for a, b, shape in parts]
        out += [(f"{g}.attn_norm.weight", f"{f}.input_layernorm.weight", rand(h), spec.norm_type),
                (f"{g}.ffn_norm.weight", f"{f}.post_attention_layernorm.weight", rand(h), spec.norm_type)]
        if spec.arch == "qwen2":
            out += [(f"{g}.attn_{p}.bias", f"{f}.self_attn.{p}_proj.bias", rand(rows), Q.F32)
                    for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
    return out


def write_tiny_gguf(path: Path, spec: TinyModelSpec | None = None,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the model to ``path``; return the float32 HF state dict it must load as."""
    spec = spec or TinyModelSpec()
    writer = GGUFWriter(str(path), spec.arch)
    a = spec.arch
    writer.add_uint32(f"{a}.context_length", 256)
    writer.add_uint32(f"{a}.embedding_length", spec.hidden_size)
    writer.add_uint32(f"{a}.block_count", spec.num_layers)
    writer.add_uint32(f"{a}.feed_forward_length", spec.intermediate_size)
    writer.add_uint32(f"{a}.attention.head_count", spec.num_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", spec.num_kv_heads)
    writer.add_float32(f"{a}.rope.freq_base", 10000.0)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, value in spec.extra_metadata.items():
        _add_value(writer, key, value)
    expected: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(seed)
    for gguf_name, hf_name, values, qtype in _hf_tensors(spec, rng):
        _, restored = _roundtrip(values, qtype)
        expected[hf_name] = torch.from_numpy(restored.copy())
        to_store = values
        if a == "llama" and ("attn_q." in gguf_name or "attn_k." in gguf_name):
            heads = spec.num_heads if "attn_q." in gguf_name else spec.num_kv_heads
            to_store = llama_cpp_permute(values, heads)
        stored, _ = _roundtrip(to_store, qtype)
        writer.add_tensor(gguf_name, stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    for name, values in spec.extra_tensors.items():
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)
