"""Property-based, speculative decoding: random workloads (chunked prefill, preemption,
prefix caching, n > 1, priority and fair policies, aborts) with drafts of random
quality, so accept lengths are random, keep test_properties.py's invariants (no block
leaks, exact reference counts, budget respected, each request's tokens exactly what
it gets alone, never more than max_tokens), and also: no block holding an unverified
token is ever hashed, and between steps every request holds exactly the blocks its
computed tokens need (rejected drafts' blocks went back to the pool)."""
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config.speculative import SpeculativeConfig
from engine_core.block_hash import extend_block_hashes
from tests.engine_core.fake_executor import default_token_fn, reference_output
from tests.engine_core.test_properties import Harness, add_op, configs, ops


class NoisyOracle:
    """Drafts the model's true continuation, each token wrong with probability
    ``p_wrong``; as the n-gram proposer (engine core) or as a draft model (worker)."""

    def __init__(self, seed: int, p_wrong: float):
        self.rng = random.Random(seed)
        self.p_wrong = p_wrong

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        truth = reference_output(list(tokens), k, default_token_fn)
        return [(t + 1) % 97 if self.rng.random() < self.p_wrong else t for t in truth]

    def propose(self, requests, num_drafts):
        return [self.drafts(r.all_token_ids, k) for r, k in zip(requests, num_drafts)]

    def forget(self, req_id):
        pass


class SpecHarness(Harness):
    """Harness with speculative decoding; checks the KV invariants of drafts."""

    def __init__(self, cfg, method, oracle, **spec_kw):
        spec = SpeculativeConfig(method=method, draft_model="x", **spec_kw)
        super().__init__({**cfg, "speculative_config": spec,
                          "draft_fn": oracle.drafts if method == "draft_model" else None})
        self.cfg = cfg
        if method == "ngram":
            self.sched.speculator.proposer = oracle

    def step(self):
        super().step()
        outputs = self.engine.executor.outputs
        if outputs:
            so = outputs[-1]
            for req_id, k in so.num_spec_tokens.items():
                assert so.num_scheduled_tokens[req_id] == k + 1

    def check_state(self):
        super().check_state()
        bs = self.cfg["block_size"]
        for req_id, blocks in self.kv.req_to_blocks.items():
            request = self.sched.requests[req_id]
            assert len(blocks) == -(-request.num_computed_tokens // bs), req_id
            extend_block_hashes(request, bs, self.kv.hash_fn)  # hashes of known tokens
            for i, block in enumerate(blocks):
                if block.block_hash is not None:  # only ever over known tokens
                    assert (i + 1) * bs <= request.num_tokens, (req_id, i)
                    assert block.block_hash == request.block_hashes[i], (req_id, i)
        for engine_id, tokens in self.tokens.items():
            assert len(tokens) <= self.expected[engine_id][1], engine_id


@st.composite
def spec_configs(draw):
    cfg = draw(configs())
    cfg["policy"] = draw(st.sampled_from(["fcfs", "priority", "fair"]))
    return cfg


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=spec_configs(), burst=st.lists(add_op, max_size=6), script=ops,
       method=st.sampled_from(["ngram", "draft_model"]), k=st.integers(1, 5),
       adaptive=st.booleans(), p_wrong=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
       seed=st.integers(0, 2**16))
def test_random_accept_lengths_keep_invariants_and_finish(cfg, burst, script, method, k,
                                                          adaptive, p_wrong, seed):
    harness = SpecHarness(cfg, method, NoisyOracle(seed, p_wrong),
                          num_speculative_tokens=k, enable_adaptive=adaptive)
    harness.run(burst, script)
    stats = harness.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    if p_wrong == 1.0:
        assert stats.num_accepted_tokens == 0
