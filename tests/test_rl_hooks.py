"""The offline RL hooks on the tiny Llama (tied embeddings, so the K-major head copy is
in play): sleep and wake at both levels, weight updates checked against a fresh LLM on
the same weights, refused updates that change nothing, prefix-cache resets and
collective_rpc on a declared extension."""
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.model_control import EngineSleepingError
from engine_core.sampling_params import SamplingParams
from worker.weight_update import WeightUpdateError
from worker.worker_extension import RPCRefused

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
EXTENSION = "tests.rl_extension:ChecksumExtension"


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 17, 40, 70)]


@pytest.fixture(scope="module")
def make_llm(tiny_llama_dir, default_model_path):
    from folio import LLM

    def make(model=tiny_llama_dir, **overrides):
        kw = dict(model=str(model), tokenizer=str(default_model_path), dtype="float32",
                  max_model_len=512, num_blocks=64, block_size=16,
                  enable_sleep_mode=True, worker_extension_cls=EXTENSION,
                  **{"observability.log_level": "warning"})
        return LLM(**{**kw, **overrides})
    return make


def run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_greedy_outputs(make_llm, prompts, level):
    llm = make_llm()
    before = run(llm, prompts)
    kv_bytes = sum(c.numel() * c.element_size() for c in llm.runner.kv_caches)
    llm.sleep(level)
    assert llm.is_sleeping() and llm.runner.kv_caches == []
    weights = sum(p.numel() for p in llm.runner.model.parameters())
    assert (weights == 0) == (level == 2)
    with pytest.raises(EngineSleepingError):
        llm.generate("hello", GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert sum(c.numel() * c.element_size() for c in llm.runner.kv_caches) == kv_bytes
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == before
    # the KV behind every cached prefix was freed: nothing may come from the cache
    assert [o.num_cached_tokens for o in again] == [0] * len(prompts)


def test_sleep_needs_sleep_mode(make_llm):
    llm = make_llm(enable_sleep_mode=False)
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        llm.sleep(1)
    assert not llm.is_sleeping()


def test_update_weights_matches_a_fresh_llm_and_back(make_llm, prompts, tiny_llama_dir,
                                                     perturbed_llama_dir):
    llm = make_llm()
    original = run(llm, prompts)
    expected = run(make_llm(model=perturbed_llama_dir), prompts)
    assert expected != original  # the nudge changes what the model says
    down = "layers.1.mlp.down_proj.weight"
    sums = (llm.collective_rpc("weight_checksum", (down,))[0],
            llm.collective_rpc("head_checksum")[0])
    assert llm.update_weights(perturbed_llama_dir / "model.safetensors") > 0
    assert run(llm, prompts) == expected
    new_sums = (llm.collective_rpc("weight_checksum", (down,))[0],
                llm.collective_rpc("head_checksum")[0])
    assert new_sums[0] != sums[0] and new_sums[1] != sums[1]  # the tied head's copy too
    llm.update_weights(tiny_llama_dir)  # a folder
    assert run(llm, prompts) == original
    assert (llm.collective_rpc("weight_checksum", (down,))[0],
            llm.collective_rpc("head_checksum")[0]) == sums


def test_update_from_a_state_dict_of_some_weights(make_llm, prompts, perturbed_llama_dir):
    """A partial in-memory update: only the q/k/v rows of layer 0 (fused in Folio)."""
    llm = make_llm()
    original = run(llm, prompts)
    nudged = load_file(str(perturbed_llama_dir / "model.safetensors"))
    part = {n: t for n, t in nudged.items() if n.startswith("model.layers.0.self_attn.")
            and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
    assert llm.update_weights(part) == 3
    changed = run(llm, prompts)
    assert changed != original
    reference = make_llm()
    reference.update_weights({n: t.clone() for n, t in part.items()})
    assert run(reference, prompts) == changed


@pytest.mark.parametrize("bad, tensor", [
    ({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 63)},
     "model.layers.0.mlp.up_proj.weight"),
    ({"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)},
     "model.layers.9.mlp.up_proj.weight"),
    ({"model.norm.weight": torch.full((64,), float("nan"))}, "model.norm.weight"),
])
def test_bad_update_changes_nothing(make_llm, prompts, perturbed_llama_dir, tmp_path, bad, tensor):
    llm = make_llm()
    original = run(llm, prompts)
    down = llm.collective_rpc("weight_checksum", ("layers.0.mlp.down_proj.weight",))
    # good tensors first, the bad one last: none of them may land
    good = load_file(str(perturbed_llama_dir / "model.safetensors"))
    path = tmp_path / "bad.safetensors"
    save_file({**good, **bad}, str(path))
    with pytest.raises(WeightUpdateError, match=tensor.replace(".", r"\.")) as info:
        llm.update_weights(path)
    assert info.value.tensor == tensor
    assert llm.collective_rpc("weight_checksum", ("layers.0.mlp.down_proj.weight",)) == down
    assert run(llm, prompts) == original
    with pytest.raises(WeightUpdateError):
        llm.update_weights(tmp_path / "missing.safetensors")


def test_cached_prompt_is_not_served_from_cache_after_update(make_llm, prompts,
                                                             perturbed_llama_dir):
    llm = make_llm()
    prompt = [{"prompt_token_ids": prompts[3]}]  # 70 tokens: 4 full blocks
    llm.generate(prompt, GREEDY, use_tqdm=False)
    hit = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 64
    llm.update_weights(perturbed_llama_dir)
    after = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 64


def test_reset_prefix_cache(make_llm, prompts):
    llm = make_llm()
    prompt = [{"prompt_token_ids": prompts[2]}]  # 40 tokens: 2 full blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 32
    llm.reset_prefix_cache()
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_collective_rpc_refuses_what_the_extension_does_not_define(make_llm):
    llm = make_llm()
    for method in ("_private", "__init__", "execute_model", "__class__"):
        with pytest.raises(RPCRefused):
            llm.collective_rpc(method)
    no_extension = make_llm(worker_extension_cls=None)
    with pytest.raises(RPCRefused, match="extension_cls"):
        no_extension.collective_rpc("weight_checksum", ("norm.weight",))


def test_update_untied_model_with_biases(make_llm, prompts, tiny_qwen2_dir, tmp_path):
    """Qwen2: q/k/v biases land in their rows of the fused bias, the untied head too."""
    import shutil
    weights = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    nudged = {n: (t + 0.05 * torch.randn(t.shape, generator=gen)).contiguous()
              for n, t in weights.items()}
    folder = tmp_path / "qwen2_nudged"
    shutil.copytree(tiny_qwen2_dir, folder)
    save_file(nudged, str(folder / "model.safetensors"), metadata={"format": "pt"})
    llm = make_llm(model=tiny_qwen2_dir)
    original = run(llm, prompts)
    expected = run(make_llm(model=folder), prompts)
    assert expected != original
    assert llm.update_weights(nudged) == len(weights)
    assert run(llm, prompts) == expected
    llm.update_weights(tiny_qwen2_dir)
    assert run(llm, prompts) == original
