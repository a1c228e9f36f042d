"""Self-consistency: the same greedy tokens whatever the scheduler does around them.

Runs on a tiny random Llama in float32: chunked prefill on/off (budget down to 16),
prefix caching on/off and on a repeated request, forced preemption in a small pool,
and each prompt alone against all of them in one batch.
"""
import random

import pytest

from engine_core.sampling_params import SamplingParams

PROMPT_LENS = [5, 17, 33, 64, 100, 130, 9, 48, 200, 1, 75, 31]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(n)]}
            for n in PROMPT_LENS]


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(prompts, tiny_llama_dir, default_model_path):
    from folio import LLM
    llm = LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_path), dtype="float32",
              max_model_len=512, num_blocks=512, enable_prefix_caching=False,
              **{"observability.log_level": "warning"})
    out = tokens(llm.generate(prompts, PARAMS, use_tqdm=False))
    assert all(len(t) == 24 for t in out)
    return out


@pytest.mark.parametrize("overrides", [
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=100),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    dict(enable_prefix_caching=True),
    dict(max_num_seqs=3),
    dict(block_size=4),
])
def test_scheduling_knobs_do_not_change_greedy_tokens(make_tiny_llm, prompts, reference,
                                                      overrides):
    llm = make_tiny_llm(**overrides)
    assert tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == reference


def test_prefix_cache_hit_on_repeat_gives_same_tokens(make_tiny_llm, prompts, reference):
    llm = make_tiny_llm(enable_prefix_caching=True)
    first = tokens(llm.generate(prompts, PARAMS, use_tqdm=False))
    before = llm.engine.get_stats()
    second_outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    after = llm.engine.get_stats()
    assert first == reference and tokens(second_outputs) == reference
    assert after.prefix_cache_hits > before.prefix_cache_hits
    # every prompt of at least one full block (16 tokens) after the first reuses blocks
    assert all(o.num_cached_tokens > 0 for o, n in zip(second_outputs, PROMPT_LENS) if n > 16)


def test_forced_preemption_gives_same_tokens(make_tiny_llm, prompts, reference):
    # 30 usable blocks of 16 tokens cannot hold all twelve requests at once
    llm = make_tiny_llm(num_blocks=31, max_model_len=256)
    assert tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == reference
    assert llm.engine.num_preemptions > 0


def test_alone_vs_inside_a_batch_of_32(make_tiny_llm, prompts, reference):
    llm = make_tiny_llm()
    rng = random.Random(1)
    filler = [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(rng.randint(1, 90))]}
              for _ in range(32 - len(prompts))]
    batch = tokens(llm.generate(filler[:10] + prompts + filler[10:], PARAMS, use_tqdm=False))
    assert batch[10:10 + len(prompts)] == reference
    alone = [tokens(llm.generate(p, PARAMS, use_tqdm=False))[0] for p in prompts[:4]]
    assert alone == reference[:4]
