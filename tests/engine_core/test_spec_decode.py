"""Speculative decoding in the engine core: n-gram drafts, adaptive k, the scheduler's
grants and the bookkeeping of verification (num_computed_tokens, KV blocks, stops)."""
import random

import pytest

from config.speculative import SpeculativeConfig
from engine_core.outputs import FinishReason
from engine_core.sampling_params import SamplingParams
from engine_core.spec.draft_length import PROBE_INTERVAL, DraftLength, k_for_alpha
from engine_core.spec.ngram_proposer import NgramProposer
from engine_core.structured_outputs import StructuredOutputReport
from tests.engine_core.factories import make_engine, make_request, run_to_completion
from tests.engine_core.fake_executor import FakeExecutor, reference_output


PERIOD = 7
PROMPT = [10, 11, 12, 13, 14, 15, 16] * 2


def cycle(tokens):
    """A model that repeats its last PERIOD tokens forever: n-gram's best case."""
    return tokens[len(tokens) - PERIOD]


def ngram(**kw):
    return SpeculativeConfig(**{"method": "ngram", "num_speculative_tokens": 4,
                                "prompt_lookup_min": 1, "prompt_lookup_max": 3, **kw})


def tokens_of(outs):
    return [t for o in outs for t in o.new_token_ids]


# ---- the n-gram proposer ----------------------------------------------------------

def propose(token_lists, ks, min_n=1, max_n=3):
    requests = [make_request(f"r{i}", t) for i, t in enumerate(token_lists)]
    return NgramProposer(min_n, max_n).propose(requests, ks)


def test_ngram_takes_the_longest_match_then_the_latest():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    # "1 2 3" (n=3) occurs earlier once, at 4..6: what followed was 8 7 1 2 3
    assert propose([tokens], [3]) == [[8, 7, 1]]
    # with n capped at 2, "2 3" (at 5..6) is the only earlier match too
    assert propose([tokens], [2], max_n=2) == [[8, 7]]
    # "1 2" occurs at 1..2, 4..5 and 9..10: the latest earlier (4..5) wins for n=2
    assert propose([[5, 1, 2, 9, 1, 2, 6, 0, 1, 2]], [2], max_n=2) == [[6, 0]]


def test_ngram_batch_mixes_lengths_misses_and_limits():
    got = propose([[1, 2, 3, 1, 2], [4, 5, 6], [9, 9, 9, 9], [3], [1, 2, 3] * 3],
                  [5, 2, 2, 4, 5])
    # r0: "1 2" at 0..1 → 3 1 2 (only 3 follow); r1: no repeat; r2: "9 9 9" ends at 2,
    # one 9 follows; r4: "1 2 3" ends at 5 (3 follow) and at 2 (6 follow): 2 fills k
    assert got == [[3, 1, 2], [], [9], [], [1, 2, 3, 1, 2]]
    assert propose([[1, 2, 1, 2]], [1], min_n=3) == [[]]


def brute_force_ngram(tokens, k, min_n, max_n):
    """The rule, one request at a time: the longest n-gram ending the tokens that occurs
    earlier; among its earlier ends, the one with most followers (up to k), then the
    latest."""
    last = len(tokens) - 1
    for n in range(max_n, min_n - 1, -1):
        ends = [e for e in range(n - 1, last) if tokens[e - n + 1:e + 1] == tokens[-n:]]
        if n <= len(tokens) - 1 and ends:
            best = max(ends, key=lambda e: (min(last - e, k), e))
            return tokens[best + 1:best + 1 + k]
    return []


def test_ngram_batch_matches_the_rule_request_by_request():
    rng = random.Random(4)
    for trial in range(200):
        batch = [[rng.randrange(4) for _ in range(rng.randint(1, 40))]
                 for _ in range(rng.randint(1, 6))]
        ks = [rng.randint(1, 6) for _ in batch]
        min_n, max_n = rng.randint(1, 3), rng.randint(3, 5)
        want = [brute_force_ngram(t, k, min_n, max_n) for t, k in zip(batch, ks)]
        assert propose(batch, ks, min_n, max_n) == want, (batch, ks, min_n, max_n)


def test_ngram_mirror_follows_appended_tokens():
    proposer = NgramProposer(1, 2)
    request = make_request("r", [1, 2, 3])
    assert proposer.propose([request], [2]) == [[]]
    request.append_output_token_ids([1, 2])
    assert proposer.propose([request], [2]) == [[3, 1]]


# ---- adaptive k --------------------------------------------------------------------

def test_adaptive_k_shrinks_to_zero_probes_and_grows_back():
    lengths = DraftLength(max_k=5)
    assert lengths.next_k("r") == 1  # the prior: alpha 0.3
    lengths.record("r", 1, 1)
    assert lengths.next_k("r") == 3
    lengths.record("r", 3, 3)
    assert lengths.next_k("r") == 5  # a copying request: two steps to k_max
    for _ in range(5):
        lengths.record("r", 2, 0)
    assert lengths.next_k("r") == 0
    ks = [lengths.next_k("r") for _ in range(PROBE_INTERVAL)]
    assert ks == [0] * (PROBE_INTERVAL - 2) + [1, 0]  # the 8th idle step probes
    grown = []
    for _ in range(4):  # probes that hit bring k back
        lengths.record("r", 1, 1)
        grown.append(lengths.next_k("r"))
    assert grown == [1, 3, 4, 5]
    assert DraftLength(max_k=5, is_adaptive=False).next_k("r") == 5
    busy = DraftLength(max_k=5)  # 32 running: a probe every 64 idle steps
    busy.record("r", 2, 0)
    busy.record("r", 2, 0)
    ks = [busy.next_k("r", num_running=32) for _ in range(64)]
    assert ks == [0] * 63 + [1]
    assert [k_for_alpha(a, 5) for a in (1.0, 0.9, 0.5, 0.3, 0.1)] == [5, 5, 2, 1, 0]


# ---- scheduling and verification ----------------------------------------------------

def test_ngram_drafts_are_verified_and_outputs_unchanged():
    prompt = PROMPT
    engine = make_engine(block_size=4, max_num_batched_tokens=64, token_fn=cycle,
                         speculative_config=ngram(enable_adaptive=False))
    engine.add_request("a", prompt, SamplingParams(max_tokens=30))
    outs = run_to_completion(engine)["a"]
    assert tokens_of(outs) == reference_output(prompt, 30, cycle)
    stats = engine.get_stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # 30 tokens in far fewer steps than 30: 4 drafts + 1 per verified step
    decode_steps = [so for so in engine.executor.outputs if so.num_spec_tokens]
    assert len(decode_steps) <= 30 // 5 + 2
    ks = [so.num_spec_tokens["a"] for so in decode_steps]
    assert max(ks) == 4 and stats.num_drafts == len(ks)
    assert stats.num_accepted_tokens_per_pos == [sum(k > i for k in ks) for i in range(4)]


def test_drafts_count_against_the_budget_and_never_pass_max_tokens():
    prompt = PROMPT
    engine = make_engine(block_size=4, max_num_batched_tokens=16, token_fn=cycle,
                         speculative_config=ngram(enable_adaptive=False))
    for i in range(3):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=7 + i))
    by_req = run_to_completion(engine)
    for i in range(3):
        assert tokens_of(by_req[f"r{i}"]) == reference_output(prompt, 7 + i, cycle)
    for so in engine.executor.outputs:
        assert so.total_num_scheduled_tokens <= 16
        for req_id, k in so.num_spec_tokens.items():
            assert so.num_scheduled_tokens[req_id] == k + 1


def test_rejected_drafts_roll_back_progress_and_free_their_blocks():
    config = SpeculativeConfig(method="draft_model", draft_model="x",
                               num_speculative_tokens=4, enable_adaptive=False)
    wrong = lambda tokens, k: [96] * k  # noqa: E731  (cycle() never emits 96)
    prompt = PROMPT  # 14 tokens
    engine = make_engine(block_size=2, max_num_batched_tokens=64, token_fn=cycle,
                         speculative_config=config, draft_fn=wrong)
    engine.add_request("a", prompt, SamplingParams(max_tokens=6))
    kv = engine.scheduler.kv_cache_manager
    engine.step()  # the prompt: 7 blocks, samples one token
    request = engine.scheduler.requests["a"]
    assert (request.num_computed_tokens, kv.num_blocks_of("a")) == (14, 7)
    free = kv.num_free_blocks
    engine.step()  # computes positions 14..18 (3 more blocks); all 4 drafts rejected
    so = engine.executor.outputs[-1]
    assert so.num_spec_tokens == {"a": 4} and so.num_scheduled_tokens == {"a": 5}
    assert (request.num_computed_tokens, request.num_tokens) == (15, 16)
    # blocks 8 and 9 held only positions 16..18 (rejected drafts): back in the pool
    assert kv.num_blocks_of("a") == 8 and kv.num_free_blocks == free - 1
    assert not any(b.block_hash for b in kv.req_to_blocks["a"][7:])
    engine.step()  # the runner hears of the two dropped blocks before appending
    assert engine.executor.outputs[-1].scheduled_cached_reqs[0].num_dropped_blocks == 2
    by_req = run_to_completion(engine)
    assert tokens_of(by_req["a"]) == reference_output(prompt, 6, cycle)[3:]
    assert engine.get_stats().spec_decode.num_accepted_tokens == 0
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    prompt = PROMPT
    stop = 13  # the 4th output token
    engine = make_engine(block_size=4, max_num_batched_tokens=64, token_fn=cycle,
                         speculative_config=ngram(enable_adaptive=False))
    engine.add_request("a", prompt, SamplingParams(max_tokens=20, stop_token_ids=[stop]))
    outs = run_to_completion(engine)["a"]
    assert tokens_of(outs) == reference_output(prompt, 20, cycle, stop_token_ids=(stop,))
    assert len(tokens_of(outs)) == 4 and outs[-1].finish_reason is FinishReason.STOP
    assert engine.executor.outputs[1].num_spec_tokens == {"a": 4}  # the run held more


def test_disable_by_batch_size_and_the_draft_model_path():
    prompt = PROMPT
    engine = make_engine(block_size=4, max_num_batched_tokens=64, token_fn=cycle,
                         speculative_config=ngram(disable_by_batch_size=1))
    for i in range(2):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=5))
    run_to_completion(engine)
    assert not any(so.num_spec_tokens for so in engine.executor.outputs)
    # draft_model: the engine core grants k slots, the worker (here draft_fn) drafts
    config = SpeculativeConfig(method="draft_model", draft_model="x",
                               num_speculative_tokens=3, enable_adaptive=False)
    oracle = lambda tokens, k: reference_output(tokens, k, cycle)  # noqa: E731
    engine = make_engine(block_size=4, token_fn=cycle, speculative_config=config,
                         draft_fn=oracle)
    engine.add_request("a", prompt, SamplingParams(max_tokens=12))
    assert tokens_of(run_to_completion(engine)["a"]) == reference_output(prompt, 12, cycle)
    specs = [so for so in engine.executor.outputs if so.num_spec_tokens]
    assert specs and all(not so.spec_token_ids for so in specs)
    assert engine.get_stats().spec_decode.num_accepted_tokens == sum(
        so.num_spec_tokens["a"] for so in specs)


@pytest.mark.parametrize("spec", [None, ngram()])
def test_stats_are_absent_without_speculation(spec):
    engine = make_engine(speculative_config=spec)
    assert (engine.get_stats().spec_decode is None) == (spec is None)


class DeferringVerifier(FakeExecutor):
    """Defers ``req_id`` once in a step that verifies its drafts, as the worker does
    when its grammar is still compiling: nothing comes back, and the last token and
    every draft must be computed again."""

    def __init__(self, block_size: int, req_id: str):
        super().__init__(block_size, cycle)
        self.req_id, self.deferred_at = req_id, None

    def _sample(self, so):
        state = self.states.get(self.req_id)
        drafts = self.drafts.get(self.req_id, [])
        defer = self.deferred_at is None and bool(drafts) and so.num_spec_tokens
        if defer:
            self.deferred_at = self.num_steps
            state.tokens = state.tokens[:-len(drafts)]
            state.num_computed_tokens = len(state.tokens) - 1
            del state.fingerprints[state.num_computed_tokens:]
            del self.drafts[self.req_id]
        out = super()._sample(so)
        if defer:
            out.structured_output = StructuredOutputReport(deferred_req_ids=[self.req_id])
        return out


def test_a_constrained_request_is_served_and_a_deferral_gives_back_its_drafts():
    """Structured outputs and speculation go together (the worker masks every verified
    position); a sample deferred in a step that verifies k drafts gets nothing and
    steps back k+1 tokens, its draft-only blocks are dropped, and it goes on to the
    same output."""
    engine = make_engine(block_size=4, token_fn=cycle, speculative_config=ngram())
    engine.executor = DeferringVerifier(4, "a")
    engine.add_request("a", PROMPT, SamplingParams(
        max_tokens=12, structured_outputs={"regex": "[a-z]+"}))
    assert tokens_of(run_to_completion(engine)["a"]) == reference_output(PROMPT, 12, cycle)
    assert engine.executor.deferred_at is not None
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1
