"""The scheduler's side of speculative decoding: who verifies how many drafts, and what
their verification does to ``num_computed_tokens`` and the KV blocks.

A decoding request has computed all its known tokens but the last (c = N - 1). With
k drafts its step computes the last token plus the drafts, one k+1-token chunk::

    position     c      c+1   ...  c+k
    input        t[c]   d1    ...  dk          num_computed_tokens += k + 1 (at schedule)
    output       x0     x1    ...  xk          the model's next token after each input

The worker accepts d1..da while d_i == x_{i-1} (rejection sampling when random) and
returns d1..da plus one token of its own: a + 1 tokens. The k - a rejected drafts'
K/V slots hold wrong values, so ``num_computed_tokens`` steps back by k - a and the
next step overwrites those slots; blocks that held only rejected drafts go back to
the pool. Drafts never enter ``all_token_ids``, so no block holding one is hashed.

Drafts are granted after the policy's planner has made its grants, from the budget
it left, to running decodes in running order, without preempting anyone: they only
ever use room nothing else wanted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from config.speculative import SpeculativeConfig
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from engine_core.spec.draft_length import DraftLength
from engine_core.spec.ngram_proposer import NgramProposer
from engine_core.step_plan import StepPlan


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counters, as vLLM names them (a draft: one request's drafts in one
    step; ``num_accepted_tokens_per_pos[i]``: drafts accepted at position i)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DraftOutcome:
    """One request's drafts in one step: how many were verified, how many accepted."""

    num_draft_tokens: int
    num_accepted_tokens: int


class Speculator:
    """Grants drafts (``grant_drafts``) and applies their verification (``on_verified``)."""

    def __init__(self, config: SpeculativeConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.lengths = DraftLength(config.num_speculative_tokens, config.enable_adaptive)
        # ngram: the engine core proposes; draft_model: the worker does.
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.last_outcomes: dict[str, DraftOutcome] = {}  # of the last updated step

    def grant_drafts(self, plan: StepPlan, running: list[Request]) -> None:
        """Add drafts to the running decodes of ``plan`` within its budget left."""
        self.last_outcomes = {}
        limit = self.config.disable_by_batch_size
        if plan.token_budget == 0 or (limit is not None and len(running) > limit):
            return
        candidates, wanted = [], []
        for request in running:
            k = self._wanted(request, plan, len(running))
            if k > 0:
                candidates.append(request)
                wanted.append(k)
        if not candidates:
            return
        proposals = (self.proposer.propose(candidates, wanted) if self.proposer is not None
                     else [None] * len(candidates))
        for request, k, drafts in zip(candidates, wanted, proposals):
            k = min(k if drafts is None else len(drafts), plan.token_budget)
            if k == 0:
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, 1 + k)
            if new_blocks is None:
                continue  # no KV room: drafts never preempt
            plan.add_drafts(request, k, new_blocks.get_block_ids(),
                            None if drafts is None else drafts[:k])

    def _wanted(self, request: Request, plan: StepPlan, num_running: int) -> int:
        """Drafts ``request`` could verify this step (0: it is not a plain decode)."""
        if (plan.num_scheduled_tokens.get(request.req_id) != 1
                or request.req_id not in plan.cached_reqs
                or request.num_computed_tokens != request.num_tokens - 1):
            return 0
        # k + 1 tokens may come back: never past max_tokens or max_model_len.
        room = min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens + 1) - 1
        return min(room, self.lengths.next_k(request.req_id, num_running)) if room > 0 else 0

    def on_verified(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        """Book a verified step: ``num_sampled`` tokens came back for ``num_drafts``
        drafts. Steps ``num_computed_tokens`` back over the rejected drafts and frees
        the blocks that held only them."""
        num_accepted = max(0, min(num_sampled - 1, num_drafts))
        num_rejected = num_drafts - num_accepted
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            self.kv_cache_manager.drop_blocks_after(request, request.num_computed_tokens)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1
        self.lengths.record(request.req_id, num_drafts, num_accepted)
        self.last_outcomes[request.req_id] = DraftOutcome(num_drafts, num_accepted)

    def forget(self, request: Request) -> None:
        """A request ended: drop its per-request state."""
        self.lengths.forget(request.req_id)
        if self.proposer is not None:
            self.proposer.forget(request.req_id)


def speculator_for(config: SpeculativeConfig | None, kv_cache_manager: KVCacheManager,
                   max_model_len: int) -> Speculator | None:
    """The scheduler's Speculator, or None when speculative decoding is off."""
    if config is None or not config.is_enabled:
        return None
    return Speculator(config, kv_cache_manager, max_model_len)
