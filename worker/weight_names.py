"""The Hugging Face Llama-layout weight names and shapes an architecture implies.

Both loaders check their output against this, so a truncated file, a mislabelled head
count or a forgotten permutation fails at load time with the tensor's name, rather than
as a shape error (or silent garbage) in the middle of a forward pass.
"""
from __future__ import annotations

import torch

from model_files.paths import UnsupportedModelError
from worker.models.architecture import ModelArchitecture


def expected_weight_shapes(arch: ModelArchitecture) -> dict[str, tuple[int, ...]]:
    """Every weight the model code will ask for, with its (out, in) shape."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q_rows = arch.num_attention_heads * arch.head_dim
    kv_rows = arch.num_key_value_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    for layer in range(arch.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes.update({
            f"{prefix}.self_attn.q_proj.weight": (q_rows, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_rows),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
        })
        if arch.attention_bias:
            shapes.update({
                f"{prefix}.self_attn.q_proj.bias": (q_rows,),
                f"{prefix}.self_attn.k_proj.bias": (kv_rows,),
                f"{prefix}.self_attn.v_proj.bias": (kv_rows,),
            })
    return shapes


def validate_state_dict(state_dict: dict[str, torch.Tensor], arch: ModelArchitecture,
                        source: object) -> None:
    """Raise UnsupportedModelError unless names and shapes match the architecture exactly."""
    expected = expected_weight_shapes(arch)
    missing = [name for name in expected if name not in state_dict]
    unexpected = [name for name in state_dict if name not in expected]
    if missing or unexpected:
        raise UnsupportedModelError(
            f"{source}: weights do not match a {arch.architecture} model of this shape; "
            f"missing {len(missing)} (e.g. {missing[:3]}), "
            f"unexpected {len(unexpected)} (e.g. {unexpected[:3]})")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise UnsupportedModelError(f"{source}: {name} has shape "
                                        f"{tuple(state_dict[name].shape)}, expected {shape}")
