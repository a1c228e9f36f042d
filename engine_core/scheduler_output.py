"""What the scheduler tells the model runner for one step: diffs, not state.

A request's token ids travel to the runner once (``NewRequestData``); after that a
step only carries the block ids appended to its block table and how many tokens to
compute (``CachedRequestData``). The runner keeps the rest per request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.worker_sampling import WorkerSamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first schedule, or resumed after preemption.

    ``token_ids`` holds the prompt followed by any tokens generated before a preemption,
    so a resumed request recomputes them. Tokens past ``num_computed_tokens`` are the
    ones this step computes (or later steps, when the prefill is chunked).
    ``sampling_params`` is the worker's part only: no stop strings, no ``max_tokens``.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: WorkerSamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int = 0
    lora_id: int = 0


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only the blocks appended since last step.

    ``num_dropped_blocks``: drop that many blocks off the end of the runner's table
    first (they held only rejected draft tokens and went back to the pool).
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_dropped_blocks: int = 0


@dataclass(slots=True)
class BlockCopy:
    """Copy every layer's K/V of block ``src`` into block ``dst`` before the forward."""

    src: int
    dst: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. ``num_scheduled_tokens`` is keyed by req_id.

    ``finished_req_ids`` lists requests that finished, were aborted or were preempted
    since the previous step: the runner drops their state before this step.

    A request with drafts computes its last known token plus the drafts (one k+1-token
    chunk) and may get up to k+1 tokens back: the accepted drafts, then the model's
    own next token.

    ``num_decode_steps`` > 1: a run of decode steps (engine_core/decode_steps.py).
    Every scheduled request is then a plain decode that computes its last known token
    and samples ``num_scheduled_tokens[r]`` times, each sampled token the next step's
    input, and gets that many tokens back.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[BlockCopy] = field(default_factory=list)
    # Prefix-cache hit tokens for requests scheduled for the first time this step.
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # Requests preempted (KV blocks reclaimed, to be recomputed) while planning this step.
    preempted_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: the last num_spec_tokens[r] of r's scheduled tokens are
    # drafts to verify. spec_token_ids[r] holds them when the engine core proposed them
    # (ngram); a request without an entry there gets them from the worker's draft model.
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_decode_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
