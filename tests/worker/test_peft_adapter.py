"""Reading PEFT adapter folders: what is served, and each refusal naming its problem."""
import dataclasses
import math
import os
import pickle
import shutil

import pytest
import torch

from tests.lora_adapters import AdapterSpec, edit_config, load_base, make_adapter
from worker.hf_loader import architecture_from_hf_config
from worker.lora.peft_adapter import LoRAAdapterError, load_peft_adapter


@pytest.fixture(scope="module")
def arch(tiny_llama_dir):
    return architecture_from_hf_config(tiny_llama_dir)


@pytest.fixture
def copy_of(tiny_lora_adapters, tmp_path):
    def copy(name):
        return shutil.copytree(tiny_lora_adapters[name], tmp_path / name)
    return copy


def test_reads_rank_scale_and_modules(tiny_lora_adapters, arch):
    qv = load_peft_adapter(tiny_lora_adapters["qv8"], arch, 16)
    assert (qv.rank, qv.scaling, qv.modules) == (8, 2.0, {"q_proj", "v_proj"})
    assert len(qv.a) == 2 * arch.num_hidden_layers
    rs = load_peft_adapter(tiny_lora_adapters["all16"], arch, 16)
    assert rs.scaling == pytest.approx(8 / math.sqrt(16))  # use_rslora: alpha / sqrt(r)
    assert len(rs.modules) == 7
    a, b = rs.a[(1, "down_proj")], rs.b[(1, "down_proj")]
    assert a.shape == (16, arch.intermediate_size) and b.shape == (arch.hidden_size, 16)
    assert a.dtype == b.dtype == torch.float32 and b.abs().sum() > 0


class Bomb:
    """Unpickling this writes a file: the test fails if anything ever unpickles it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_bin_is_refused_and_never_opened(copy_of, arch, tmp_path):
    folder = copy_of("qv8")
    (folder / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "adapter_model.bin").write_bytes(pickle.dumps(Bomb(str(marker))))
    with pytest.raises(LoRAAdapterError, match="adapter_model.bin holds pickled weights"):
        load_peft_adapter(folder, arch, 16)
    assert not marker.exists()


@pytest.mark.parametrize("changes,message", [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is not supported"),
    ({"use_dora": True}, "DoRA adapters"),
    ({"target_modules": ["q_proj", "lm_head"]}, "unknown target module 'lm_head'"),
    ({"bias": "lora_only"}, "trained biases"),
    ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
    ({"r": 4}, r"layer \d+ \w+\.lora_[AB] has shape"),
], ids=["modules_to_save", "dora_flag", "unknown_target", "bias", "rank_pattern",
        "shape_vs_rank"])
def test_config_refusals_name_the_problem(copy_of, arch, changes, message):
    folder = edit_config(copy_of("qv8"), **changes)
    with pytest.raises(LoRAAdapterError, match=message):
        load_peft_adapter(folder, arch, 16)


def test_rank_over_max_lora_rank_is_refused(tiny_lora_adapters, arch):
    with pytest.raises(LoRAAdapterError, match=r"rank 16 exceeds lora.max_lora_rank \(8\)"):
        load_peft_adapter(tiny_lora_adapters["all16"], arch, 8)


def test_shapes_that_do_not_match_the_base_model(tiny_lora_adapters, arch):
    wider = dataclasses.replace(arch, hidden_size=96)
    with pytest.raises(LoRAAdapterError, match=r"has shape \(8, 64\).*needs \(8, 96\)"):
        load_peft_adapter(tiny_lora_adapters["qv8"], wider, 16)
    fewer = dataclasses.replace(arch, num_hidden_layers=1)
    with pytest.raises(LoRAAdapterError, match="the adapter has layer 1; the base model has 1"):
        load_peft_adapter(tiny_lora_adapters["qv8"], fewer, 16)


@pytest.mark.parametrize("kind", ["dora", "lm_head", "modules_to_save"])
def test_real_peft_adapters_of_unsupported_kinds(tiny_llama_dir, arch, tmp_path, kind):
    from peft import LoraConfig, get_peft_model
    config = {"dora": LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
              "lm_head": LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
              "modules_to_save": LoraConfig(r=4, target_modules=["q_proj"],
                                            modules_to_save=["lm_head"])}[kind]
    get_peft_model(load_base(tiny_llama_dir), config).save_pretrained(tmp_path / kind)
    message = {"dora": "DoRA", "lm_head": "unknown target module 'lm_head'",
               "modules_to_save": "modules_to_save"}[kind]
    with pytest.raises(LoRAAdapterError, match=message):
        load_peft_adapter(tmp_path / kind, arch, 16)
    # the tensors alone give each one away, whatever the config claims
    edit_config(tmp_path / kind, target_modules=["q_proj"], use_dora=False,
                modules_to_save=[])
    with pytest.raises(LoRAAdapterError, match=message):
        load_peft_adapter(tmp_path / kind, arch, 16)


def test_folders_and_files_that_are_not_adapters(copy_of, arch, tmp_path):
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path / "missing", arch, 16)
    folder = copy_of("qv8")
    (folder / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(LoRAAdapterError, match="not a readable safetensors file"):
        load_peft_adapter(folder, arch, 16)
    outside = copy_of("mlp4") / "adapter_model.safetensors"
    (folder / "adapter_model.safetensors").unlink()
    os.symlink(outside, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="link that leads out of the adapter folder"):
        load_peft_adapter(folder, arch, 16)
    with pytest.raises(LoRAAdapterError) as err:
        load_peft_adapter(tmp_path / "missing", arch, 16)
    assert str(tmp_path) not in str(err.value)  # messages never carry full paths


def test_all_linear_targets_are_read_from_the_tensors(tiny_llama_dir, arch, tmp_path):
    folder = make_adapter(load_base(tiny_llama_dir), tmp_path / "a",
                          AdapterSpec(rank=2, targets=("q_proj",)))
    edit_config(folder, target_modules="all-linear")
    assert load_peft_adapter(folder, arch, 16).modules == {"q_proj"}
