"""Property-based: random add/abort/step sequences over tiny pools keep every invariant.

The executor is the fake runner (it checks every K/V slot a request attends to), so
besides bookkeeping these runs also check that prefix hits, forks and preemption
never make a request read K/V that is not its own prefix.
"""
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.outputs import FinishReason
from engine_core.sampling_params import InvalidRequestError, SamplingParams
from tests.engine_core.factories import make_engine
from tests.engine_core.fake_executor import reference_output

@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    pool_tokens = draw(st.integers(6, 36))  # tiny pools: preemption is common
    return {
        "num_blocks": max(2, pool_tokens // block_size) + 1,
        "block_size": block_size,
        # mostly no longer than the pool, so most requests fit and compete for it
        "max_model_len": draw(st.integers(4, pool_tokens + 4)),
        "max_num_batched_tokens": draw(st.integers(1, 12)),
        "max_num_seqs": draw(st.integers(1, 5)),
        "enable_chunked_prefill": draw(st.booleans()),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_prefix_caching": draw(st.booleans()),
    }


add_op = st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 8), st.integers(1, 3),
                   st.sampled_from([None, "s"]), st.integers(0, 2), st.integers(0, 2))
ops = st.lists(st.one_of(add_op, add_op, st.tuples(st.just("abort"), st.integers(0, 30)),
                         st.tuples(st.just("step"), st.integers(1, 4))), min_size=4, max_size=30)


def prompt_for(variant: int, length: int) -> list[int]:
    # prompts of one variant share prefixes, so prefix hits happen
    return [(variant * 31 + i) % 97 for i in range(length)]


class Harness:
    """Drives an engine and checks invariants after every step."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.engine = make_engine(**cfg)
        self.sched = self.engine.scheduler
        self.kv = self.sched.kv_cache_manager
        self.expected: dict[str, tuple[list[int], int]] = {}  # engine id -> (prompt, max)
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        self.parents: list[str] = []

    def add_op(self, op):
        self.add(*op[1:])

    def run(self, burst, script):
        """Requests of ``burst`` arrive together (they compete for the pool), then the
        ``script``'s adds, aborts and steps; then drain and check the end state."""
        for op in burst:
            self.add_op(op)
        for op in script:
            if op[0] == "add":
                self.add_op(op)
            elif op[0] == "abort":
                self.abort(op[1])
            else:
                for _ in range(op[1]):
                    self.step()
        self.drain()
        self.check_final()

    def add(self, length, max_tokens, n, salt, priority, variant, **request_kw):
        req_id = f"q{len(self.parents)}"
        self.parents.append(req_id)
        prompt = prompt_for(variant, length)
        params = SamplingParams(n=n, max_tokens=max_tokens, priority=priority)
        try:
            ids = self.engine.add_request(req_id, prompt, params, cache_salt=salt,
                                          **request_kw)
        except InvalidRequestError as err:
            assert err.param in ("prompt", "max_tokens")
            bs, usable = self.cfg["block_size"], self.cfg["num_blocks"] - 1
            total = length + max_tokens
            assert (total > self.cfg["max_model_len"] or -(-total // bs) > usable
                    or (not self.cfg["enable_chunked_prefill"]
                        and length > self.cfg["max_num_batched_tokens"]))
            return
        for engine_id in ids:
            self.expected[engine_id] = (prompt, max_tokens)

    def abort(self, k):
        if self.parents:
            self.engine.abort_request(self.parents[k % len(self.parents)])

    def step(self):
        outs = self.engine.step()
        so = self.engine.executor.outputs[-1] if self.engine.executor.outputs else None
        for out in outs:
            assert out.req_id not in self.finish, f"output after finish: {out.req_id}"
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish[out.req_id] = out.finish_reason
        if so is not None:
            assert so.total_num_scheduled_tokens <= self.cfg["max_num_batched_tokens"]
            assert len(so.num_scheduled_tokens) <= self.cfg["max_num_seqs"]
            assert all(n > 0 for n in so.num_scheduled_tokens.values())
        self.check_state()

    def check_state(self):
        self.kv.block_pool.check_invariants()
        assert len(self.sched.running) <= self.cfg["max_num_seqs"]
        # every reference is held by exactly one live request's block table
        refs = Counter(b.block_id for blocks in self.kv.req_to_blocks.values() for b in blocks)
        for block in self.kv.block_pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert set(self.kv.req_to_blocks) <= set(self.sched.requests)
        # the queue's running token sum (backpressure reads it) stays exact
        assert self.sched.waiting.num_tokens == sum(r.num_tokens for r in self.sched.waiting)
        for req in self.sched.requests.values():
            assert 0 <= req.num_computed_tokens <= req.num_tokens <= self.cfg["max_model_len"]
            state = self.engine.executor.states.get(req.req_id)
            if state is not None and req.status.name == "RUNNING":
                assert state.tokens == req.all_token_ids

    def drain(self):
        bound = 50 + 40 * sum(len(p) + m for p, m in self.expected.values())
        for _ in range(bound):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        assert not self.engine.has_unfinished_requests(), "livelock"

    def check_final(self):
        pool = self.kv.block_pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert set(self.finish) == set(self.expected), "a request never got a final output"
        for engine_id, (prompt, max_tokens) in self.expected.items():
            want = reference_output(prompt, max_tokens, max_model_len=self.cfg["max_model_len"])
            got = self.tokens.get(engine_id, [])
            if self.finish[engine_id] is FinishReason.ABORT:
                assert got == want[:len(got)]
            else:
                assert got == want and self.finish[engine_id] is FinishReason.LENGTH


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), burst=st.lists(add_op, max_size=6), script=ops)
def test_random_workloads_keep_invariants_and_finish(cfg, burst, script):
    Harness(cfg).run(burst, script)
