"""Issue 17 with speculative decoding, offline, on the tiny random Llama (float32): the
worker masks every verified position along the drafts, so constrained outputs are
token for token what they are without speculation, and valid, with n-gram drafts and
with the model as its own draft; free requests beside them are unchanged; seeded
sampling with n > 1 draws the same tokens with drafts, under forced preemption and
from the prefix cache.

The random model never repeats itself, so besides the real n-gram proposer an oracle
proposes each sample's true continuation with random mistakes: accepted runs and
drafts the grammar bans both happen (tests/oracle_proposer.py, as tests/test_spec_decode.py
uses it)."""
import pytest

from engine_core.sampling_params import SamplingParams
from tests.oracle_proposer import OracleProposer
from tests.test_structured_output import CASES, PERSON, _valid

PROMPTS = ["Answer:", "Reply now:", "Output please:", "Go:"]
FREE_PROMPTS = ["free one", "free two", "free three"]
FREE = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def constrained(temperature=0.0, **kw):
    return [SamplingParams(max_tokens=40, temperature=temperature, structured_outputs=fields,
                           **kw) for _, _, fields in CASES]


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, default_model_path):
    """Greedy constrained and free outputs without speculation, in one batch."""
    from folio import LLM
    llm = LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_path), dtype="float32",
              max_model_len=512, num_blocks=256, **{"observability.log_level": "warning"})
    return llm.generate(FREE_PROMPTS + PROMPTS, [FREE] * 3 + constrained(), use_tqdm=False)


def check_valid(outputs):
    for (kind, value, _), out in zip(CASES, outputs):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (kind, sample.text)
            assert _valid(sample.text, kind, value), (kind, sample.text)


@pytest.mark.parametrize("method", ["ngram", "ngram_oracle", "self_draft"])
def test_greedy_constrained_and_free_outputs_equal_those_without_speculation(
        make_tiny_llm, tiny_llama_draft_dir, reference, method):
    kw = {"speculative.enable_adaptive": False, "num_speculative_tokens": 4}
    if method == "self_draft":
        llm = make_tiny_llm(speculative_method="draft_model",
                            speculative_draft_model=str(tiny_llama_draft_dir), **kw)
    else:
        llm = make_tiny_llm(speculative_method="ngram", prompt_lookup_min=1, **kw)
    if method == "ngram_oracle":
        llm.engine.scheduler.speculator.proposer = OracleProposer(reference, seed=5)
    outs = llm.generate(FREE_PROMPTS + PROMPTS, [FREE] * 3 + constrained(), use_tqdm=False)
    assert tokens(outs) == tokens(reference)
    check_valid(outs[3:])
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_draft_tokens > 0
    if method == "ngram_oracle":  # some accepted, some rejected (by the grammar mostly)
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if method == "self_draft":  # drafts follow the grammar too: the target agrees
        assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("pool", [{}, {"num_blocks": 10, "max_model_len": 112}],
                         ids=["roomy", "preempting"])
def test_seeded_constrained_samples_n2_draw_the_same_tokens_with_drafts(make_tiny_llm,
                                                                        pool):
    """n-gram drafts leave a seeded request's tokens as they are without drafts (the
    verifier's exponential race is the sampler's), grammar or not: n = 2 samples each
    with their own matcher, preemption replaying them, then a prefix-cache hit."""
    params = constrained(temperature=1.0, seed=3, n=2)
    prompts = [f"{p} item number {i}, described at some length in the form asked for, "
               f"so that its prompt fills at least one whole block of the cache"
               for i, p in enumerate(PROMPTS)]  # > 16 tokens: one full block
    plain = make_tiny_llm(**pool).generate(prompts, params, use_tqdm=False)
    llm = make_tiny_llm(speculative_method="ngram", **pool,
                        **{"speculative.enable_adaptive": False})
    llm.engine.scheduler.speculator.proposer = OracleProposer(plain, seed=5)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(spec) == tokens(plain)
    check_valid(spec)
    assert all(len({c.text for c in o.outputs}) == 2 or o.outputs[0].text in CASES[1][1]
               for o in spec)  # two matchers per request (choices may coincide)
    stats = llm.engine.get_stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if pool:
        assert llm.engine.num_preemptions > 0
    again = llm.generate(prompts[3:], params[3:], use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16
    assert tokens([again]) == tokens(plain[3:])


def test_the_model_as_its_own_draft_sampling_stays_valid(make_tiny_llm, tiny_llama_draft_dir):
    """Sampled drafts, each drawn from the draft model's distribution masked by the
    grammar (the q the verifier divides by), against the masked target: outputs match
    their grammars, and the model drafting for itself is accepted (p == q)."""
    llm = make_tiny_llm(speculative_method="draft_model", num_speculative_tokens=3,
                        speculative_draft_model=str(tiny_llama_draft_dir),
                        **{"speculative.enable_adaptive": False})
    outs = llm.generate(PROMPTS, constrained(temperature=0.9, seed=8, n=2), use_tqdm=False)
    check_valid(outs)
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0
    assert PERSON == CASES[3][1]


def test_ignore_eos_ends_at_the_grammar_end_with_drafts_as_without(make_tiny_llm,
                                                                   tiny_llama_draft_dir):
    """The model drafting for itself proposes the EOS a complete grammar forces, and
    more after it: that EOS ends the sample ("stop"), as it does without drafts. (An EOS
    where the grammar could still go on does not: ignore_eos holds there.)"""
    params = constrained(ignore_eos=True)
    plain = make_tiny_llm().generate(PROMPTS, params, use_tqdm=False)
    llm = make_tiny_llm(speculative_method="draft_model", num_speculative_tokens=4,
                        speculative_draft_model=str(tiny_llama_draft_dir),
                        **{"speculative.enable_adaptive": False})
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(spec) == tokens(plain)
    check_valid(spec)
    eos = set(llm.engine.eos_token_ids)
    assert all(out.outputs[0].token_ids[-1] in eos for out in spec)
    assert llm.engine.get_stats().spec_decode.num_accepted_tokens > 0
