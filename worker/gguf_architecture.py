"""ModelArchitecture from a GGUF header (``{arch}.*`` keys and the tokenizer's special ids)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from model_files.gguf_file import GGUFFile
from model_files.paths import UnsupportedModelError
from worker.models.architecture import ModelArchitecture, RopeScaling

# GGUF `general.architecture` → ModelArchitecture.architecture. Mistral models convert to
# "llama" (same tensors, same rope permutation), so there is no separate entry for them.
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Every Llama 3.x release uses these two; llama.cpp keeps only the resulting factors.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_REQUIRED = object()


def architecture_from_gguf(gguf: GGUFFile) -> ModelArchitecture:
    """Read the model shape from a GGUF's metadata; UnsupportedModelError for other families."""
    arch = gguf.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; Folio runs "
            f"{sorted(SUPPORTED_GGUF_ARCHITECTURES)} (Llama, Mistral and Qwen2 models)")

    def key(name: str, default: Any = _REQUIRED) -> Any:
        value = gguf.metadata.get(f"{arch}.{name}", default)
        if value is _REQUIRED:
            raise UnsupportedModelError(f"{gguf.path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden_size = int(key("embedding_length"))
    num_heads = _uniform(key("attention.head_count"), f"{arch}.attention.head_count")
    num_kv_heads = _uniform(key("attention.head_count_kv", num_heads),
                            f"{arch}.attention.head_count_kv")
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedModelError(
            f"{gguf.path}: partial rotary embeddings ({rope_dims} of {head_dim} dims) "
            f"are not supported")
    rope_theta = float(key("rope.freq_base", 10000.0))
    sliding_window = key("attention.sliding_window", None)
    return ModelArchitecture(
        architecture=SUPPORTED_GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(gguf, key),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(gguf, key, head_dim, rope_theta),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=_optional_int(gguf.metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=_eos_token_ids(gguf),
    )


def _uniform(value: Any, key: str) -> int:
    # Some GGUFs store a per-layer array here; Folio needs the same count in every layer.
    if isinstance(value, np.ndarray):
        if value.size == 0 or not np.all(value == value[0]):
            raise UnsupportedModelError(f"{key} varies across layers ({value.tolist()})")
        return int(value[0])
    return int(value)


def _vocab_size(gguf: GGUFFile, key) -> int:
    # The embedding matrix is what the model must be built to hold; the token list and
    # `{arch}.vocab_size` agree with it in every converter output seen so far.
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is not None:
        return int(embedding.shape[0])
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    return int(key("vocab_size", len(tokens) if tokens is not None else _REQUIRED))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _eos_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """eos plus end-of-turn / end-of-message ids: generation stops at any of them."""
    ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = gguf.metadata.get(f"tokenizer.ggml.{name}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _rope_scaling(gguf: GGUFFile, key, head_dim: int, rope_theta: float) -> RopeScaling | None:
    kind = str(key("rope.scaling.type", "none"))
    if ROPE_FREQS_TENSOR in gguf.tensors:
        factors = np.asarray(gguf.raw_tensor(ROPE_FREQS_TENSOR), dtype=np.float64)
        return llama3_scaling_from_factors(factors, head_dim, rope_theta)
    if kind == "none":
        return None
    raise UnsupportedModelError(f"{gguf.path}: rope scaling {kind!r} is not supported "
                                f"(only Llama 3 style scaling is)")


def llama3_rope_factors(scaling: RopeScaling, head_dim: int, rope_theta: float) -> np.ndarray:
    """Per-frequency divisors of the rotary inverse frequencies under Llama 3 scaling.

    High frequencies (wavelength < original_len / high_freq_factor) keep 1, low ones
    (wavelength > original_len / low_freq_factor) are divided by ``factor``, and the band
    between blends the two: ``1 / ((1 - s) / factor + s)`` with ``s`` rising from 0 to 1.
    """
    inv_freq = rope_theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = scaling.original_max_position_embeddings
    smooth = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    factors = np.where(wavelen < orig / scaling.high_freq_factor, 1.0, blended)
    return np.where(wavelen > orig / scaling.low_freq_factor, scaling.factor, factors)


def llama3_scaling_from_factors(factors: np.ndarray, head_dim: int,
                                rope_theta: float) -> RopeScaling | None:
    """Recover the Llama 3 RopeScaling that llama.cpp flattened into ``rope_freqs.weight``.

    ``factor`` is the plateau (largest divisor); inside the blend band each divisor gives
    ``original_len = wavelength * (s * (high - low) + low)``. The result is checked by
    regenerating the factors; anything that does not reproduce them is refused.
    """
    if factors.shape != (head_dim // 2,):
        raise UnsupportedModelError(f"rope_freqs has shape {factors.shape}, expected "
                                    f"({head_dim // 2},)")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    inv_freq = rope_theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    band = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    if not band.any():
        raise UnsupportedModelError("rope_freqs has no blend band; cannot recover the "
                                    "Llama 3 rope scaling parameters")
    low, high = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    smooth = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    original = float(np.median(wavelen[band] * (smooth * (high - low) + low)))
    scaling = RopeScaling(rope_type="llama3", factor=factor, low_freq_factor=low,
                          high_freq_factor=high,
                          original_max_position_embeddings=int(round(original)))
    if not np.allclose(llama3_rope_factors(scaling, head_dim, rope_theta), factors, rtol=1e-3):
        raise UnsupportedModelError("rope_freqs does not follow Llama 3 scaling; unsupported")
    return scaling
