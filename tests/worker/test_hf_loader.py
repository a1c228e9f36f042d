"""Hugging Face checkpoint folders → ModelArchitecture + state dict."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

from worker.hf_loader import architecture_from_hf_config
from worker.loader import load_model
from model_files.paths import ModelFileError, UnsupportedModelError
from worker.models.architecture import RopeScaling

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _save(model_class, config, folder, **save_kwargs):
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.save_pretrained(folder, **save_kwargs)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_same_weights(loaded, reference, tied):
    expected = {n: t for n, t in reference.items() if not (tied and n == "lm_head.weight")}
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_tiny_llama_round_trip(tmp_path):
    config = LlamaConfig(**TINY, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                         rope_theta=20000.0)
    reference = _save(LlamaForCausalLM, config, tmp_path)
    loaded = load_model(tmp_path, torch.float32)
    _assert_same_weights(loaded.state_dict, reference, tied=False)
    arch = loaded.architecture
    assert arch.architecture == "llama"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (96, 32, 64)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (2, 4, 2)
    assert arch.head_dim == 8 and arch.max_position_embeddings == 128
    assert arch.rope_theta == 20000.0 and arch.rope_scaling is None
    assert arch.rms_norm_eps == 1e-6 and not arch.tie_word_embeddings
    assert not arch.attention_bias and arch.sliding_window is None
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)
    assert loaded.source_path == tmp_path.resolve() and loaded.load_seconds > 0


def test_tiny_qwen2_round_trip_with_bias_and_tied_embeddings(tmp_path):
    config = Qwen2Config(**TINY, tie_word_embeddings=True)
    reference = _save(Qwen2ForCausalLM, config, tmp_path)
    loaded = load_model(tmp_path, torch.float32)
    _assert_same_weights(loaded.state_dict, reference, tied=True)
    arch = loaded.architecture
    assert arch.architecture == "qwen2" and arch.attention_bias and arch.tie_word_embeddings
    assert loaded.state_dict["model.layers.0.self_attn.k_proj.bias"].shape == (16,)
    assert "lm_head.weight" not in loaded.state_dict


def test_dtype_cast_and_sharded_checkpoint(tmp_path):
    config = LlamaConfig(**TINY)
    reference = _save(LlamaForCausalLM, config, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path, "bfloat16")
    assert {t.dtype for t in loaded.state_dict.values()} == {torch.bfloat16}
    bf16_reference = {n: t.to(torch.bfloat16) for n, t in reference.items()}
    _assert_same_weights(loaded.state_dict, bf16_reference, tied=False)


def test_missing_shard_is_reported(tmp_path):
    _save(LlamaForCausalLM, LlamaConfig(**TINY), tmp_path, max_shard_size="20KB")
    sorted(tmp_path.glob("model-*.safetensors"))[0].unlink()
    with pytest.raises(ModelFileError, match="missing"):
        load_model(tmp_path, torch.float32)


def test_llama3_rope_scaling_and_generation_eos(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(**TINY, rope_scaling=scaling, rope_theta=500000.0)
    _save(LlamaForCausalLM, config, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    arch = architecture_from_hf_config(tmp_path)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert arch.eos_token_ids == (2, 7, 9)


def test_transformers_4_style_config(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_theta": 123.0,
              "rope_scaling": {"type": "llama3", "factor": 2.0,
                               "original_max_position_embeddings": 32},
              "head_dim": 16, "tie_word_embeddings": True, "eos_token_id": [5, 6]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = architecture_from_hf_config(tmp_path)
    assert arch.rope_theta == 123.0 and arch.rope_scaling.factor == 2.0
    assert arch.rope_scaling.original_max_position_embeddings == 32
    assert arch.head_dim == 16 and arch.tie_word_embeddings and arch.eos_token_ids == (5, 6)


def test_mistral_sliding_window(tmp_path):
    config = MistralConfig(**TINY, sliding_window=48, head_dim=8)
    reference = _save(MistralForCausalLM, config, tmp_path)
    loaded = load_model(tmp_path, torch.float32)
    assert loaded.architecture.architecture == "mistral"
    assert loaded.architecture.sliding_window == 48
    _assert_same_weights(loaded.state_dict, reference, tied=False)


def test_qwen2_sliding_window_only_when_enabled(tmp_path):
    base = {"architectures": ["Qwen2ForCausalLM"], **TINY, "sliding_window": 32}
    (tmp_path / "config.json").write_text(json.dumps({**base, "use_sliding_window": False}))
    assert architecture_from_hf_config(tmp_path).sliding_window is None
    (tmp_path / "config.json").write_text(json.dumps(
        {**base, "use_sliding_window": True, "max_window_layers": 0}))
    assert architecture_from_hf_config(tmp_path).sliding_window == 32
    (tmp_path / "config.json").write_text(json.dumps(
        {**base, "use_sliding_window": True, "max_window_layers": 1}))
    with pytest.raises(UnsupportedModelError, match="some layers"):
        architecture_from_hf_config(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "SiLU"),
])
def test_unsupported_configs_are_refused(tmp_path, change, message):
    config = {"architectures": ["LlamaForCausalLM"], **TINY, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message):
        architecture_from_hf_config(tmp_path)


def test_folder_without_weights_or_with_wrong_shapes(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **TINY}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="safetensors"):
        load_model(tmp_path, torch.float32)
    _save(LlamaForCausalLM, LlamaConfig(**TINY), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(UnsupportedModelError, match="mlp"):
        load_model(tmp_path, torch.float32)
