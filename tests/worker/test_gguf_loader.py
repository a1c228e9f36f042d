"""GGUF → ModelArchitecture + HF-layout state dict."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.worker.conftest import load_transformers_gguf_state_dict, tensor_digest
from tests.worker.gguf_factory import TinyModelSpec, llama_cpp_permute, write_tiny_gguf
from worker.gguf_architecture import (architecture_from_gguf, llama3_rope_factors,
                                      llama3_scaling_from_factors)
from model_files.gguf_file import GGUFFile
from worker.gguf_loader import dequantize_tensor, hf_tensor_name, unpermute_rope_rows
from worker.loader import load_model
from model_files.paths import UnsupportedModelError
from worker.models.architecture import RopeScaling

Q = GGMLQuantizationType


# --- the default model -------------------------------------------------------------------

def test_default_model_architecture(default_model):
    arch = default_model.architecture
    assert arch.architecture == "llama"
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert arch.vocab_size == 49152
    assert arch.tie_word_embeddings and "lm_head.weight" not in default_model.state_dict
    assert arch.max_position_embeddings == 8192
    assert arch.rope_theta == 100000.0 and arch.rope_scaling is None
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)
    assert not arch.attention_bias and arch.sliding_window is None
    assert all(t.dtype == torch.float32 for t in default_model.state_dict.values())


def test_default_model_equals_transformers_gguf_loading(default_model, transformers_gguf_digests,
                                                        default_gguf_path):
    state_dict = default_model.state_dict
    assert set(state_dict) == set(transformers_gguf_digests)
    for name, tensor in state_dict.items():
        assert list(tensor.shape) == transformers_gguf_digests[name]["shape"], name
    mismatched = [name for name, tensor in state_dict.items()
                  if tensor_digest(tensor) != transformers_gguf_digests[name]["sha256"]]
    if mismatched:  # not bit-identical: fall back to the full reference and allclose
        reference = load_transformers_gguf_state_dict(default_gguf_path)
        for name in mismatched:
            torch.testing.assert_close(state_dict[name], reference[name], rtol=1e-5, atol=1e-6)


def test_default_model_q_rows_really_needed_unpermuting(default_model, default_gguf_path):
    # Guards the test above: the stored rows differ from HF's, so skipping the un-permute
    # would have been caught.
    raw_q = dequantize_tensor(GGUFFile(default_gguf_path), "blk.0.attn_q.weight")
    loaded_q = default_model.state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(raw_q, loaded_q)
    torch.testing.assert_close(unpermute_rope_rows(raw_q, 9), loaded_q, rtol=0, atol=0)


# --- the permutation ---------------------------------------------------------------------

def test_unpermute_known_values():
    # One head of dim 4, one input column: GGUF stores x0 y0 x1 y1, HF wants x0 x1 y0 y1.
    gguf_rows = torch.tensor([[10.0], [20.0], [11.0], [21.0]])
    assert unpermute_rope_rows(gguf_rows, 1).flatten().tolist() == [10.0, 11.0, 20.0, 21.0]
    two_heads = torch.arange(8.0)  # a bias: heads [0 1 2 3] [4 5 6 7]
    assert unpermute_rope_rows(two_heads, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.random.default_rng(1).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = torch.from_numpy(llama_cpp_permute(weight, 3))
    assert not torch.equal(permuted, torch.from_numpy(weight))
    assert torch.equal(unpermute_rope_rows(permuted, 3), torch.from_numpy(weight))


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(UnsupportedModelError):
        unpermute_rope_rows(torch.zeros(10, 4), 4)


# --- tiny files: dequantisation, layout, names -------------------------------------------

@pytest.mark.parametrize("spec", [
    TinyModelSpec(),
    TinyModelSpec(tied=False, embed_type=Q.F32, proj_type=Q.Q8_0, norm_type=Q.F16),
    TinyModelSpec(proj_type=Q.Q4_0, embed_type=Q.Q4_1),
    TinyModelSpec(proj_type=Q.BF16, embed_type=Q.Q5_0),
], ids=["q8_0-f16-f32", "f32-q8_0-f16", "q4_1-q4_0", "q5_0-bf16"])
def test_tiny_llama_gguf_loads_to_known_values(tmp_path, spec):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", spec)
    loaded = load_model(tmp_path / "tiny.gguf", torch.float32, use_cache=False)
    assert set(loaded.state_dict) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert loaded.architecture.tie_word_embeddings == spec.tied


def test_tiny_qwen2_gguf_keeps_rows_and_biases(tmp_path):
    spec = TinyModelSpec(arch="qwen2", tied=False)
    expected = write_tiny_gguf(tmp_path / "qwen.gguf", spec)
    loaded = load_model(tmp_path / "qwen.gguf", torch.float32, use_cache=False)
    assert loaded.architecture.architecture == "qwen2" and loaded.architecture.attention_bias
    assert "model.layers.1.self_attn.q_proj.bias" in loaded.state_dict
    for name, tensor in expected.items():
        assert torch.equal(loaded.state_dict[name], tensor), name


def test_requested_dtype_is_applied(tmp_path):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(tmp_path / "tiny.gguf", "bfloat16", use_cache=False)
    assert {t.dtype for t in loaded.state_dict.values()} == {torch.bfloat16}
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(loaded.state_dict[name], expected[name].to(torch.bfloat16))


def test_q8_0_dequantisation_is_close_to_the_original_values():
    values = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    restored = dequantize(quantize(values, Q.Q8_0), Q.Q8_0)
    assert np.abs(restored - values).max() < np.abs(values).max() / 127 * 0.51 + 1e-6


def test_k_quant_tensor_shape_and_values(tmp_path):
    # No K-quant writer exists in gguf-py, so feed raw blocks with sane fp16 scales and
    # check the loader hands them to gguf.quants with the right row shape.
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(2, 210), dtype=np.uint8)  # Q6_K: 210 bytes / 256 values
    blocks[:, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    writer = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=Q.Q6_K)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    tensor = dequantize_tensor(GGUFFile(tmp_path / "k.gguf"), "blk.0.attn_q.weight")
    assert tuple(tensor.shape) == (2, 256)
    assert torch.equal(tensor, torch.from_numpy(dequantize(blocks, Q.Q6_K)))


def test_unsupported_quant_type_is_named(tmp_path):
    writer = GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        dequantize_tensor(GGUFFile(tmp_path / "iq.gguf"), "blk.0.attn_q.weight")


def test_unsupported_architecture_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "f.gguf", TinyModelSpec(arch="falcon"))
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load_model(tmp_path / "f.gguf", torch.float32, use_cache=False)


def test_wrong_head_count_fails_at_load_with_tensor_name(tmp_path):
    spec = TinyModelSpec(extra_metadata={"llama.attention.key_length": 8})
    write_tiny_gguf(tmp_path / "bad.gguf", spec)
    with pytest.raises(UnsupportedModelError, match="q_proj"):
        load_model(tmp_path / "bad.gguf", torch.float32, use_cache=False)


def test_tensor_names_map_to_hf_layout():
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(UnsupportedModelError):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


# --- rope scaling ------------------------------------------------------------------------

LLAMA32 = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def test_llama3_scaling_recovered_from_rope_freqs(tmp_path):
    factors = llama3_rope_factors(LLAMA32, head_dim=16, rope_theta=500000.0)
    assert llama3_scaling_from_factors(factors, 16, 500000.0) == LLAMA32
    spec = TinyModelSpec(extra_metadata={"llama.rope.freq_base": 500000.0},
                         extra_tensors={"rope_freqs.weight": factors})
    write_tiny_gguf(tmp_path / "l3.gguf", spec)
    loaded = load_model(tmp_path / "l3.gguf", torch.float32, use_cache=False)
    assert loaded.architecture.rope_scaling == LLAMA32
    assert not any("rope" in name for name in loaded.state_dict)


def test_rope_freqs_that_are_not_llama3_are_refused():
    factors = np.linspace(1.0, 9.0, 8)
    with pytest.raises(UnsupportedModelError):
        llama3_scaling_from_factors(factors, 16, 500000.0)


def test_other_rope_scaling_types_are_refused(tmp_path):
    write_tiny_gguf(tmp_path / "y.gguf", TinyModelSpec(extra_metadata={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        architecture_from_gguf(GGUFFile(tmp_path / "y.gguf"))


# --- the disk cache ----------------------------------------------------------------------

def test_weight_cache_round_trip_and_invalidation(tmp_path, _private_weight_cache):
    source = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(source)
    first = load_model(source, torch.float32)
    entries = list(_private_weight_cache.glob("*.safetensors"))
    assert len(entries) == 1
    second = load_model(source, torch.float32)
    assert all(torch.equal(second.state_dict[n], t) for n, t in expected.items())
    assert set(second.state_dict) == set(first.state_dict)

    write_tiny_gguf(source, seed=7)  # new contents; bump mtime in case the clock is coarse
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    third = load_model(source, torch.float32)
    assert not torch.equal(third.state_dict["model.norm.weight"], expected["model.norm.weight"])
    assert len(list(_private_weight_cache.glob("*.safetensors"))) == 1  # stale entry removed


def test_corrupt_cache_entry_is_ignored(tmp_path, _private_weight_cache):
    source = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(source)
    load_model(source, torch.float32)
    (entry,) = _private_weight_cache.glob("*.safetensors")
    entry.write_bytes(b"not safetensors")
    reloaded = load_model(source, torch.float32)
    assert torch.equal(reloaded.state_dict["model.norm.weight"], expected["model.norm.weight"])


def test_cache_can_be_switched_off(tmp_path, monkeypatch, _private_weight_cache):
    monkeypatch.setenv("FOLIO_CACHE_DIR", "off")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    load_model(tmp_path / "tiny.gguf", torch.float32)
    # nothing written beside the kernels' build link the fixture made
    assert [p.name for p in _private_weight_cache.iterdir()] == ["torch_extensions"]
