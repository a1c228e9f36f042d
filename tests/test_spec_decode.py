"""Speculative decoding end to end, offline LLM on tiny random Llamas (float32): the two
extremes of draft_model (the model as its own draft accepts every draft; a random
draft almost none, outputs unchanged), greedy identity in a batch with chunked prefill
and preemption, seeded sampling with drafts drawing exactly the tokens and logprobs it
draws without them, reproducible draft-model sampling, the start-up tokenizer check.

The tiny random models never repeat themselves, so n-gram finds nothing to propose
here; tests that need accepted n-gram drafts replace the proposer by an oracle that
proposes the model's true continuation with random mistakes (tests/test_spec_decode_
default_model.py runs the real n-gram proposer on a model that copies)."""
import random
import shutil

import pytest

from config import ConfigError
from engine_core.sampling_params import SamplingParams
from tests.conftest import _save_tiny
from tests.oracle_proposer import OracleProposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def save_tokenizer(folder, default_model_path):
    from text.tokenizer import Tokenizer
    Tokenizer.from_model_path(default_model_path).backend.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def self_draft(tiny_llama_draft_dir):
    """The tiny model itself as a draft (conftest: a copy that ships the tokenizer)."""
    return str(tiny_llama_draft_dir)


@pytest.fixture(scope="module")
def random_draft(default_model_path, tmp_path_factory):
    """Another random tiny Llama (a different seed) with the same tokenizer."""
    folder = _save_tiny(tmp_path_factory.mktemp("random_draft"), "llama", 7)
    return str(save_tokenizer(folder, default_model_path))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(n)]}
            for n in (5, 40, 17, 90, 33, 64)]


@pytest.fixture(scope="module")
def reference(prompts, tiny_llama_dir, default_model_path):
    from folio import LLM
    llm = LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_path), dtype="float32",
              max_model_len=512, num_blocks=256, **{"observability.log_level": "warning"})
    return tokens(llm.generate(prompts, GREEDY, use_tqdm=False))


def draft_llm(make_tiny_llm, draft, k=4, adaptive=False, **kw):
    return make_tiny_llm(speculative_method="draft_model", speculative_draft_model=draft,
                         num_speculative_tokens=k,
                         **{"speculative.enable_adaptive": adaptive}, **kw)


def test_the_model_as_its_own_draft_accepts_every_draft(make_tiny_llm, self_draft,
                                                        prompts, reference):
    llm = draft_llm(make_tiny_llm, self_draft, k=4)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # k per step: every run is 4 long but the last of each request (max_tokens caps it)
    assert stats.num_accepted_tokens_per_pos[3] >= stats.num_drafts - len(prompts)


def test_a_random_draft_accepts_almost_none_and_changes_nothing(make_tiny_llm, random_draft,
                                                                prompts, reference):
    llm = draft_llm(make_tiny_llm, random_draft, k=3)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    fixed = llm.engine.get_stats().spec_decode
    assert fixed.num_accepted_tokens <= 0.05 * fixed.num_draft_tokens
    adaptive = draft_llm(make_tiny_llm, random_draft, k=3, adaptive=True)
    assert tokens(adaptive.generate(prompts, GREEDY, use_tqdm=False)) == reference
    # adaptive speculation stops drafting for requests whose drafts never hit
    assert adaptive.engine.get_stats().spec_decode.num_draft_tokens \
        < 0.3 * fixed.num_draft_tokens


def test_stop_strings_and_tokens_inside_an_accepted_run(make_tiny_llm, self_draft, prompts,
                                                       reference):
    plain = make_tiny_llm()
    text = plain.generate(prompts[2], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 4]  # some text in the middle
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
              SamplingParams(temperature=0.0, max_tokens=24,
                             stop_token_ids=[reference[3][9]])]
    want = plain.generate([prompts[2], prompts[3]], params, use_tqdm=False)
    llm = draft_llm(make_tiny_llm, self_draft, k=4)  # every draft accepted: runs of 5
    got = llm.generate([prompts[2], prompts[3]], params, use_tqdm=False)
    for w, g in zip(want, got):
        assert (g.outputs[0].text, g.outputs[0].token_ids, g.outputs[0].finish_reason) \
            == (w.outputs[0].text, w.outputs[0].token_ids, w.outputs[0].finish_reason)
    assert got[0].outputs[0].finish_reason == "stop" and stop not in got[0].outputs[0].text
    assert got[1].outputs[0].token_ids == reference[3][:10]  # ends on the stop token


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identity_in_a_batch_with_chunked_prefill_and_preemption(
        make_tiny_llm, self_draft, prompts, reference, method):
    rng = random.Random(1)
    filler = [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(rng.randint(1, 60))]}
              for _ in range(10)]
    # 15 usable blocks of 16 tokens cannot hold all 16 requests: preemption is forced
    llm = make_tiny_llm(num_blocks=16, max_model_len=160, max_num_batched_tokens=24,
                        speculative_method=method, speculative_draft_model=self_draft,
                        prompt_lookup_min=1)
    pair = SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(filler[:5] + prompts + filler[5:] + [prompts[1]],
                        [GREEDY] * (len(filler) + len(prompts)) + [pair], use_tqdm=False)
    assert tokens(outs[5:5 + len(prompts)]) == reference
    assert [c.token_ids for c in outs[-1].outputs] == [reference[1]] * 2  # n = 2 forks
    assert llm.engine.num_preemptions > 0
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1


SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True,
                   logprobs=2),
    SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=12, max_tokens=20,
                   ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.6, seed=13, max_tokens=20, repetition_penalty=1.3,
                   min_tokens=5, logprobs=0),
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1),
]


@pytest.mark.parametrize("pool", [{}, {"num_blocks": 8, "max_model_len": 112}],
                         ids=["roomy", "preempting"])
def test_seeded_sampling_draws_the_same_tokens_and_logprobs_with_drafts(make_tiny_llm,
                                                                        prompts, pool):
    chosen = prompts[:4]
    plain = make_tiny_llm(**pool).generate(chosen, SAMPLED, use_tqdm=False)
    llm = make_tiny_llm(speculative_method="ngram", **pool,
                        **{"speculative.enable_adaptive": False})
    llm.engine.scheduler.speculator.proposer = OracleProposer(plain, seed=3)
    spec = llm.generate(chosen, SAMPLED, use_tqdm=False)
    assert tokens(spec) == tokens(plain)
    stats = llm.engine.get_stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for a, b in zip(plain, spec):
        if a.outputs[0].logprobs is None:
            assert b.outputs[0].logprobs is None
            continue
        for x, y in zip(a.outputs[0].token_logprobs, b.outputs[0].token_logprobs):
            # float rounding differs between a chunk and a decode: near-ties may swap
            assert x.token_id == y.token_id and abs(x.rank - y.rank) <= 2
            assert x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    if pool:
        assert llm.engine.num_preemptions > 0


def test_draft_model_sampling_is_reproducible(make_tiny_llm, self_draft, prompts):
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True)
    llm = draft_llm(make_tiny_llm, self_draft, k=3, adaptive=True)
    alone = tokens(llm.generate(prompts[1], params, use_tqdm=False))
    again = tokens(llm.generate(prompts[:3], [SamplingParams(temperature=1.0, max_tokens=9),
                                              params, SamplingParams(temperature=0.5)],
                                use_tqdm=False))
    assert again[1] == alone[0]
    # the model drafting for itself is accepted whatever it samples (p == q)
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0


def test_the_draft_must_share_the_models_tokenizer(make_tiny_llm, tiny_llama_dir, tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    with pytest.raises(ValueError, match="cannot read its tokenizer"):
        draft_llm(make_tiny_llm, str(tiny_llama_dir))  # no tokenizer.json there
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    Backend(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(
        str(other / "tokenizer.json"))
    with pytest.raises(ValueError, match="differs from the model's"):
        draft_llm(make_tiny_llm, str(other))
    with pytest.raises(ConfigError, match="draft_model"):
        make_tiny_llm(speculative_method="draft_model")
