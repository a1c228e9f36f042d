"""Grammar-guided drafting: the draft model proposes only tokens the grammar allows.

Verification alone keeps constrained outputs valid (the target's rows are masked along
the drafts, grammar_step.py), but a draft model that does not know the grammar wastes
drafts on tokens the mask then rejects. While the draft model proposes, each
constrained request's matcher is moved along its drafts so that pass j's draft logits
are masked at output + d1..dj, then rolled back, so the matcher is unchanged when the
step's masks are filled::

    pass      0          1              ...   k-1
    matcher   output     output + d1    ...   output + d1..d(k-1)    then rolled back
    draft     d1         d2             ...   dk    (each allowed where it stands)

A sampled draft is drawn from the masked draft distribution, and that masked q is what
the rejection sampler divides by, so verification stays exact. A grammar not yet
compiled (or failed) guides nothing: its drafts are the draft model's own.
"""
from __future__ import annotations

import torch

from text.grammar_compiler import allocate_bitmask
from worker.request_state import CachedRequestState
from worker.structured_output.grammar_step import disallowed_tokens, mask_rows
from worker.structured_output.request_grammar import RequestGrammar


class DraftGuide:
    """The matchers of one proposal's constrained requests (``states[i]``'s by ``i``)."""

    def __init__(self, states: list[CachedRequestState], vocab_size: int):
        self.grammars: dict[int, RequestGrammar] = {
            i: s.grammar for i, s in enumerate(states)
            if s.grammar is not None and s.grammar.is_ready and not s.grammar.failed}
        self._num_consumed = dict.fromkeys(self.grammars, 0)
        self._bitmask = allocate_bitmask(len(states), vocab_size)

    def mask(self, logits: torch.Tensor, active: list[int]) -> None:
        """Mask row r of ``logits`` (``active[r]``'s next draft) by its grammar, in place."""
        rows = [r for r, i in enumerate(active) if i in self.grammars]
        if not rows:
            return
        for r in rows:
            self.grammars[active[r]].fill(self._bitmask, r)
        mask_rows(logits, rows, disallowed_tokens(self._bitmask[rows], logits.shape[-1]))

    def advance(self, i: int, token_id: int) -> None:
        """``states[i]`` drafted ``token_id``: move its matcher past it (EOS: no-op)."""
        grammar = self.grammars.get(i)
        if grammar is not None and grammar.advance_draft(token_id):
            self._num_consumed[i] += 1

    def finish(self) -> None:
        """Roll every matcher back to where the proposal found it."""
        for i, grammar in self.grammars.items():
            grammar.rollback(self._num_consumed[i])
