"""A deterministic stand-in for the model runner, for engine-core tests.

It follows the runner's contract exactly (drop finished state, take new/cached
request data, copy blocks, compute the scheduled tokens, sample for requests whose
computed tokens reached the end of their known tokens) and models the K/V cache:
every slot it computes holds a fingerprint of the token prefix ending there (and the
LoRA id), and before sampling it checks every slot the request attends to. Stale,
overwritten or wrongly shared blocks therefore fail the test that produced them.

Speculative decoding: drafts (from the SchedulerOutput, or from ``draft_fn`` when the
engine core left them to the worker) are written like any token, then verified
greedily against ``token_fn``: the accepted ones plus the model's own next token come
back, and the rejected ones' slots are forgotten.

A run of decode steps (``num_decode_steps`` > 1) is that many one-token steps, each
request taking part in as many as it was granted, its tokens returned together.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.outputs import ModelRunnerOutput
from engine_core.scheduler_output import SchedulerOutput

TokenFn = Callable[[list[int]], int]
DraftFn = Callable[[list[int], int], list[int]]  # (tokens, k) -> k drafts


def default_token_fn(tokens: list[int]) -> int:
    """Next token from the sequence so far: deterministic, content-dependent."""
    return (tokens[-1] * 7 + len(tokens) * 3 + 1) % 97


@dataclass
class _RunnerState:
    tokens: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: int
    fingerprints: list[int] = field(default_factory=list)

    def fingerprint(self, pos: int) -> int:
        while len(self.fingerprints) <= pos:
            prev = self.fingerprints[-1] if self.fingerprints else hash((-1, self.lora_id))
            self.fingerprints.append(hash((prev, self.tokens[len(self.fingerprints)])))
        return self.fingerprints[pos]


class FakeExecutor:
    """Implements ``ModelExecutor`` over a simulated paged K/V cache."""

    def __init__(self, block_size: int, token_fn: TokenFn = default_token_fn,
                 draft_fn: DraftFn | None = None):
        self.block_size = block_size
        self.token_fn = token_fn
        self.draft_fn = draft_fn
        self.drafts: dict[str, list[int]] = {}  # this step's drafts per request
        self.states: dict[str, _RunnerState] = {}
        self.kv: dict[int, dict[int, int]] = {}  # block id -> slot -> fingerprint
        self.outputs: list[SchedulerOutput] = []
        self.num_steps = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(so)
        self.num_steps += 1
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = _RunnerState(list(new.token_ids), list(new.block_ids),
                                                   new.num_computed_tokens, new.lora_id)
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens, cached.req_id
            if cached.num_dropped_blocks:
                del state.block_ids[-cached.num_dropped_blocks:]
            assert len(state.block_ids) * self.block_size >= state.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
        for copy in so.blocks_to_copy:
            self.kv[copy.dst] = dict(self.kv.get(copy.src, {}))
        self.drafts = {}
        for req_id, k in so.num_spec_tokens.items():
            tokens = self.states[req_id].tokens
            drafts = so.spec_token_ids.get(req_id)
            self.drafts[req_id] = list(drafts if drafts is not None
                                       else self.draft_fn(list(tokens), k))
            assert len(self.drafts[req_id]) == k, req_id
            tokens.extend(self.drafts[req_id])  # provisionally, until verified
        if so.num_decode_steps > 1:
            return self._run_decode_steps(so)
        self._write(so)
        return self._sample(so)

    def _run_decode_steps(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert not self.drafts, "a run of decode steps carries no drafts"
        remaining = dict(so.num_scheduled_tokens)
        sampled: dict[str, list[int]] = {r: [] for r in remaining}
        for _ in range(so.num_decode_steps):
            step = SchedulerOutput(num_scheduled_tokens={r: 1 for r, n in remaining.items()
                                                         if n > 0})
            for req_id in step.num_scheduled_tokens:
                state = self.states[req_id]
                assert state.num_computed_tokens == len(state.tokens) - 1, \
                    f"{req_id}: a run of decode steps must start at a plain decode"
                remaining[req_id] -= 1
            self._write(step)
            out = self._sample(step)
            for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
                sampled[req_id].extend(tokens)
        return ModelRunnerOutput(req_ids=list(sampled), sampled_token_ids=list(sampled.values()),
                                 logprobs=[None] * len(sampled))

    def _write(self, so: SchedulerOutput) -> None:
        bs = self.block_size
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed_tokens + num_tokens
            assert end <= len(state.tokens), f"{req_id}: scheduled past its known tokens"
            assert req_id not in self.drafts or end == len(state.tokens), \
                f"{req_id}: drafts must end the scheduled chunk"
            assert len(state.block_ids) * bs >= end, f"{req_id}: no slot for a token"
            for pos in range(state.num_computed_tokens, end):
                self.kv.setdefault(state.block_ids[pos // bs], {})[pos % bs] = \
                    state.fingerprint(pos)
            state.num_computed_tokens = end

    def _sample(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        bs = self.block_size
        for req_id in so.num_scheduled_tokens:
            state = self.states[req_id]
            if state.num_computed_tokens != len(state.tokens):
                continue
            for pos in range(state.num_computed_tokens):
                got = self.kv.get(state.block_ids[pos // bs], {}).get(pos % bs)
                assert got == state.fingerprint(pos), \
                    f"{req_id}: wrong K/V at position {pos} (block {state.block_ids[pos // bs]})"
            tokens = self._verify(state, self.drafts.get(req_id, []))
            out.req_ids.append(req_id)
            out.sampled_token_ids.append(tokens)
            out.logprobs.append(None)
        return out

    def _verify(self, state: _RunnerState, drafts: list[int]) -> list[int]:
        """Greedy verification: accepted drafts plus the next token; state rolled back
        over the rejected drafts."""
        known = state.tokens[:len(state.tokens) - len(drafts)]
        emitted = []
        for draft in drafts:
            token = self.token_fn(known + emitted)
            emitted.append(token)
            if token != draft:
                break
        else:
            emitted.append(self.token_fn(known + emitted))
        num_rejected = len(drafts) - (len(emitted) - 1)
        state.num_computed_tokens -= num_rejected
        del state.fingerprints[state.num_computed_tokens:]
        state.tokens = known + emitted
        return emitted


def reference_output(prompt: list[int], max_tokens: int, token_fn: TokenFn = default_token_fn,
                     stop_token_ids: tuple[int, ...] = (), max_model_len: int | None = None
                     ) -> list[int]:
    """What a request must generate, computed without any engine."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens and (max_model_len is None or len(tokens) < max_model_len):
        token = token_fn(tokens)
        tokens.append(token)
        out.append(token)
        if token in stop_token_ids:
            break
    return out
