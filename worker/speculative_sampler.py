"""Sampling a step when speculative decoding is on: every request that samples, with
or without drafts, goes through here (worker/rejection_sampler.py decides).

Row by row the target distribution is exactly the one sampling without drafts would
use at that position: row i of a request is sampled as if d_1..d_i were already its
outputs (penalties count them, min_tokens bans apply by position), with its seed,
temperature, top-k/top-p/min-p. Noise is per position too: a seeded request draws one
noise row per output position from its own generator, in order, as the plain sampler
does; rows drawn for positions its drafts did not reach wait in ``noise_rows`` for the
next step. So its generator's stream, and a preempted request's replay of it
(request_state.make_generator), stay one row per output token.

It runs on the host (k+1 rows of logits per request come over from a GPU): the
rejection sampler's ragged bookkeeping is host work. A seeded request's rows are still
drawn by its generator on its own device, as the plain sampler draws them.
"""
from __future__ import annotations

import torch

from engine_core.outputs import TokenLogprobs
from worker.draft_runner import DraftRunner, draft_probs_rows
from worker.rejection_sampler import rejection_sample
from worker.request_state import CachedRequestState
from worker.sampler import target_distribution, token_logprobs
from worker.sampling_metadata import SamplingMetadata
from worker.structured_output.grammar_step import GrammarStep


class SpeculativeSampler:
    """Turns a step's logits rows (k+1 per request with k drafts) into emitted tokens."""

    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = eos_token_ids

    def verify(self, logits: torch.Tensor, states: list[CachedRequestState],
               draft_probs: dict[str, torch.Tensor], grammar_step: GrammarStep | None,
               draft_runner: DraftRunner | None
               ) -> tuple[list[CachedRequestState], list[list[int]],
                          list[list[TokenLogprobs] | None]]:
        """A verify step of the model runner: the states that sampled, their emitted
        tokens and logprobs. Constrained rows are masked first, position by position
        along the drafts (worker/structured_output/grammar_step.py), so every accepted
        draft and the model's own token obey the grammar, and each matcher then takes
        exactly the emitted tokens; a state whose grammar is still compiling emits
        nothing (all its drafts count as rejected). Each state's progress steps back
        over its rejected drafts, as the engine core's does."""
        num_drafts = {s.req_id: len(s.spec_token_ids) for s in states}
        sampling = states
        if grammar_step is not None:
            logits, sampling = grammar_step.apply(logits, states)
        rows = draft_probs_rows(sampling, [num_drafts[s.req_id] for s in sampling],
                                draft_probs, logits.shape[-1])
        tokens, logprobs = self(logits, sampling, rows)
        if grammar_step is not None:
            grammar_step.accept(tokens)
        emitted = dict(zip((s.req_id for s in sampling), tokens))
        for state in states:
            k, n = num_drafts[state.req_id], len(emitted.get(state.req_id, ()))
            state.spec_token_ids = []  # a deferred state's too: it never reached here
            state.num_computed_tokens -= k + 1 - n
            if draft_runner is not None:
                draft_runner.on_verified(state, k, n)
        return sampling, tokens, logprobs

    def __call__(self, logits: torch.Tensor, states: list[CachedRequestState],
                 draft_probs: torch.Tensor | None = None
                 ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Emitted tokens (and their logprobs) per state, appended to its token ids;
        its drafts are cleared. ``draft_probs``: the draft model's q per row."""
        logits = logits.cpu()
        drafts = [s.spec_token_ids for s in states]
        md = self._metadata(states)
        dist = target_distribution(logits, md)
        noise = None if dist.probs is None else self._noise(states, logits.shape[-1])
        tokens = rejection_sample(dist, noise, drafts, draft_probs)
        if noise is not None:
            self._keep_unused_noise(states, tokens, noise)
        logprobs = self._logprobs(logits, states, tokens)
        for state, emitted in zip(states, tokens):
            state.token_ids.extend(emitted)
            state.spec_token_ids = []
        return tokens, logprobs

    def _metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params, prompts, outputs = [], [], []
        for s in states:
            prompt, output = s.prompt_token_ids, s.output_token_ids
            for i in range(len(s.spec_token_ids) + 1):
                params.append(s.sampling_params)
                prompts.append(prompt)
                outputs.append(output + s.spec_token_ids[:i])
        return SamplingMetadata.build(params, [None] * len(params), prompts, outputs,
                                      self.eos_token_ids)

    @staticmethod
    def _noise(states: list[CachedRequestState], vocab_size: int) -> torch.Tensor:
        num_rows = sum(len(s.spec_token_ids) + 1 for s in states)
        noise = torch.empty(num_rows, vocab_size, dtype=torch.float32).exponential_()
        row = 0
        for s in states:
            n = len(s.spec_token_ids) + 1
            if s.generator is not None:
                saved = s.noise_rows[:n]
                for i, kept in enumerate(saved):
                    noise[row + i] = kept
                for i in range(len(saved), n):  # the generator's next row, on its device
                    noise[row + i] = torch.empty(
                        vocab_size, dtype=torch.float32, device=s.generator.device,
                    ).exponential_(generator=s.generator).cpu()
                s.noise_rows = s.noise_rows[len(saved):]
            row += n
        return noise

    @staticmethod
    def _keep_unused_noise(states: list[CachedRequestState], tokens: list[list[int]],
                           noise: torch.Tensor) -> None:
        """Rows of positions not reached go back, in order, ahead of any left."""
        row = 0
        for s, emitted in zip(states, tokens):
            n = len(s.spec_token_ids) + 1
            if s.generator is not None and len(emitted) < n:
                unused = [noise[i].clone() for i in range(row + len(emitted), row + n)]
                s.noise_rows = unused + s.noise_rows
            row += n

    @staticmethod
    def _logprobs(logits: torch.Tensor, states: list[CachedRequestState],
                  tokens: list[list[int]]) -> list[list[TokenLogprobs] | None]:
        """The model's own logprobs (raw logits) of each emitted token, at its row."""
        rows, ids, wanted = [], [], []
        row = 0
        for s, emitted in zip(states, tokens):
            if s.sampling_params.logprobs is not None:
                rows.extend(range(row, row + len(emitted)))
                ids.extend(emitted)
                wanted.extend([s.sampling_params.logprobs] * len(emitted))
            row += len(s.spec_token_ids) + 1
        if not rows:
            return [None] * len(states)
        flat = iter(token_logprobs(logits[rows], torch.tensor(ids), wanted))
        return [[next(flat) for _ in emitted] if s.sampling_params.logprobs is not None
                else None for s, emitted in zip(states, tokens)]
