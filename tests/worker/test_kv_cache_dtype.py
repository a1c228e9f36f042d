"""memory.kv_cache_dtype end to end: the key, the pool's size for a byte budget, and
generation on the tiny model with an fp8 cache (prefix caching, chunked prefill, the
Triton backend, sleep mode and a draft model on top of it)."""
import random

import pytest
import torch

from config import ConfigError
from config.loader import load_config
from config.schema import MemoryConfig
from engine_core.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def greedy(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(n)]}
            for n in (7, 40, 23)]


def test_the_key_and_its_values():
    assert MemoryConfig().kv_cache_dtype == "auto"
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
        assert load_config(None, {"kv_cache_dtype": name}).memory.kv_cache_dtype == name
    with pytest.raises(ConfigError, match="memory.kv_cache_dtype"):
        MemoryConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="memory.kv_cache_dtype"):
        load_config(None, {"memory.kv_cache_dtype": "float8"})


def test_block_bytes_halve_against_bf16():
    from worker.kv_cache import KVCacheSpec, resolve_kv_cache_dtype
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    spec = {dt: KVCacheSpec(30, 16, 3, 64, dt)
            for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)}
    budget = 64 * 1024 ** 2
    bf16 = spec[torch.bfloat16].num_blocks_for(budget)
    assert spec[torch.float8_e4m3fn].num_blocks_for(budget) == 2 * bf16
    assert spec[torch.float8_e5m2].num_blocks_for(budget) == 2 * bf16
    assert spec[torch.float8_e4m3fn].num_blocks_for(budget) == \
        4 * spec[torch.float32].num_blocks_for(budget)
    # int8: 64 values + a 2-byte scale per head row, 66 bytes against bf16's 128
    int8 = KVCacheSpec(30, 16, 3, 64, torch.int8)
    assert int8.row_width == 66 and int8.bytes_per_block * 64 == spec[torch.bfloat16] \
        .bytes_per_block * 33


@pytest.mark.parametrize("dtype,factor", [("float32", 4), ("bfloat16", 2)])
def test_pool_holds_more_tokens_for_the_same_bytes(make_tiny_llm, dtype, factor):
    """Both sides of the num_blocks handshake: the worker's tensors and the engine's pool."""
    budget = 8 * 1024 ** 2
    sizes = {}
    for kv in ("auto", "fp8"):
        llm = make_tiny_llm(dtype=dtype, num_blocks=None, kv_cache_bytes=budget,
                            kv_cache_dtype=kv)
        caches = llm.runner.kv_caches
        assert caches[0].dtype == (torch.float8_e4m3fn if kv == "fp8" else getattr(torch, dtype))
        assert sum(c.numel() * c.element_size() for c in caches) <= budget
        num_blocks = caches[0].shape[1]
        assert llm.engine.scheduler.kv_cache_manager.block_pool.num_blocks == num_blocks
        sizes[kv] = num_blocks
        llm.shutdown()
    assert sizes["fp8"] == factor * sizes["auto"]


def test_fp8_generation_is_consistent_across_cache_paths(make_tiny_llm, prompts):
    """Fresh prefill, prefix-cache hit and chunked prefill all attend to the same rounded
    keys (kernels/kv_quant.py), so greedy tokens agree between them."""
    llm = make_tiny_llm(kv_cache_dtype="fp8", max_model_len=128, num_blocks=64)
    assert llm.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    # the native decode kernel where it builds, the torch reference elsewhere: both read fp8
    assert llm.runner.attention_backend.name in ("native-cpu", "torch")
    fresh = greedy(llm, prompts)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == fresh
    assert sum(o.num_cached_tokens for o in again) > 0  # the prefix cache did serve them
    chunked = make_tiny_llm(kv_cache_dtype="fp8", max_model_len=128, num_blocks=64,
                            max_num_batched_tokens=16, enable_prefix_caching=False)
    assert greedy(chunked, prompts) == fresh
    # the rounding reaches the model: the last position's logprobs move a little
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    plain = make_tiny_llm(max_model_len=128, num_blocks=64)
    a = llm.generate(prompts[1], params, use_tqdm=False)[0].outputs[0].cumulative_logprob
    b = plain.generate(prompts[1], params, use_tqdm=False)[0].outputs[0].cumulative_logprob
    assert a != b and abs(a - b) < 0.5


def test_int8_cache_on_the_cpu(make_tiny_llm, prompts):
    """int8 rows with their scales: 16 values + 2 bytes per head row of the tiny model
    (32 bytes in bfloat16), consistent across the cache paths; read by torch only."""
    budget = 4 * 1024 ** 2
    bf16 = make_tiny_llm(dtype="bfloat16", num_blocks=None, kv_cache_bytes=budget)
    llm = make_tiny_llm(dtype="bfloat16", num_blocks=None, kv_cache_bytes=budget,
                        kv_cache_dtype="int8", max_model_len=128)
    cache = llm.runner.kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape[-1] == 18
    assert cache.shape[1] == bf16.runner.kv_caches[0].shape[1] * 32 // 18
    assert llm.runner.attention_backend.name == "torch"
    fresh = greedy(llm, prompts)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == fresh
    assert sum(o.num_cached_tokens for o in again) > 0
    chunked = make_tiny_llm(dtype="bfloat16", kv_cache_dtype="int8", max_model_len=128,
                            num_blocks=64, max_num_batched_tokens=16,
                            enable_prefix_caching=False)
    assert greedy(chunked, prompts) == fresh


def test_int8_is_refused_where_only_fp8_is_read(make_tiny_llm):
    with pytest.raises(ConfigError, match="memory.kv_cache_dtype=int8.*"
                                          "worker.attention_backend=triton"):
        make_tiny_llm(kv_cache_dtype="int8", attention_backend="triton")


def test_triton_backend_reads_fp8(make_tiny_llm, prompts):
    """The interpreted Triton kernel over the fp8 pool gives the reference's tokens."""
    kw = dict(kv_cache_dtype="fp8_e5m2", max_model_len=128, num_blocks=32,
              max_num_batched_tokens=24)
    small = prompts[:2]
    triton_llm = make_tiny_llm(attention_backend="triton", **kw)
    assert triton_llm.runner.attention_backend.is_triton
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ours = greedy(triton_llm, small, params)
    assert ours == greedy(make_tiny_llm(attention_backend="torch", **kw), small, params)


def test_sleep_mode_reallocates_the_fp8_pool(make_tiny_llm, prompts):
    llm = make_tiny_llm(kv_cache_dtype="fp8", enable_sleep_mode=True, max_model_len=128,
                        num_blocks=64)
    before = greedy(llm, prompts)
    llm.sleep(1)
    assert llm.runner.kv_caches == []
    llm.wake_up()
    assert llm.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert llm.runner.kv_caches[0].shape[1] == 64
    assert greedy(llm, prompts) == before


def test_draft_model_keeps_its_own_fp8_pool(make_tiny_llm, tiny_llama_draft_dir, prompts):
    kw = dict(kv_cache_dtype="fp8", max_model_len=128, num_blocks=64)
    reference = greedy(make_tiny_llm(**kw), prompts)
    llm = make_tiny_llm(speculative_method="draft_model",
                        speculative_draft_model=str(tiny_llama_draft_dir),
                        num_speculative_tokens=3, **kw)
    draft = llm.runner.draft_runner
    assert draft.kv_caches[0].dtype == torch.float8_e4m3fn
    assert draft.kv_caches[0].shape[1] == llm.runner.kv_caches[0].shape[1]
    assert greedy(llm, prompts) == reference
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens > 0  # the model as its own draft: its drafts hold
