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
    part_types: dict[str, Q] = field(default_factory=dict)  # e.g. {"ffn_down": Q.Q6_K}
    extra_metadata: dict[str, Any] = field(default_factory=dict)
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)  # stored as F32


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Float rows (a multiple of 256 long) as Q4_K bytes: per 32 values a 4-bit range from
    the block's min to its max, its scale and min in 6 bits under fp16 d and dmin per 256.
    (A plain rounding, not llama.cpp's search: the bytes are what matters to a reader.)"""
    rows = values.reshape(-1, 8, 32).astype(np.float32)  # [superblocks, blocks, 32]
    lo = np.minimum(rows.min(-1), 0)
    scale, mins = (rows.max(-1) - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    inv = lambda v: np.where(v > 0, 1 / np.maximum(v, 1e-30), 0)  # noqa: E731
    sc = np.clip(np.rint(scale * inv(d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins * inv(dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint((rows + offset[..., None]) * inv(step)[..., None]), 0, 15).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # chunk i: blocks 2i, 2i + 1
    out = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), packed, qs], axis=1)
    return out.reshape(values.shape[0], -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Float rows as Q6_K bytes: per 16 values a symmetric 6-bit range, its scale an int8
    under an fp16 d per 256 (plain rounding, like quantize_q4_k)."""
    rows = values.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(rows).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    inv = lambda v: np.where(v > 0, 1 / np.maximum(v, 1e-30), 0)  # noqa: E731
    sc = np.clip(np.rint(scale * inv(d.astype(np.float32))[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    u = (np.clip(np.rint(rows * inv(step)[..., None]), -32, 31) + 32).astype(np.uint8)
    u = u.reshape(-1, 2, 4, 32)  # [sb, half, quarter, l]: value 128 h + 32 s + l
    ql = np.concatenate([(u[:, :, 0] & 15) | (u[:, :, 2] & 15) << 4,
                         (u[:, :, 1] & 15) | (u[:, :, 3] & 15) << 4], axis=2).reshape(-1, 128)
    qh = (u[:, :, 0] >> 4 | (u[:, :, 1] >> 4) << 2 | (u[:, :, 2] >> 4) << 4
          | (u[:, :, 3] >> 4) << 6).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1)
    return out.reshape(values.shape[0], -1)


_K_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}


def _roundtrip(values: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to store, float32 values a reader must get back)."""
    stored = _K_QUANTIZERS[qtype](values) if qtype in _K_QUANTIZERS else quantize(values, qtype)
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
        out += [(f"{g}.{a}.weight", f"{f}.{b}.weight", rand(*shape),
                 spec.part_types.get(a, spec.proj_type)) for a, b, shape in parts]
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
