"""One step's token masks: filled on a thread while the forward runs, then applied.

    begin ─▶ mask thread: fill the bitmask rows of each constrained state whose grammar
    │        is ready (llguidance releases the GIL, so this overlaps the forward); with
    │        k drafts, k+1 rows: one per verified position (request_grammar.fill_drafts)
    forward (main thread)
    apply ─▶ join; rows whose compile finished meanwhile are filled now; rows still
             compiling are deferred (removed from this step's sampling); the constrained
             rows' logits outside their masks become -inf. Unconstrained rows are never
             touched, so their tokens are exactly what they would be without grammars.
    accept ─▶ each constrained row's matcher consumes the tokens it emitted (with drafts:
             the accepted ones and the verifier's own), so it holds exactly the output.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from worker.request_state import CachedRequestState
from worker.structured_output.request_grammar import RequestGrammar

def disallowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bool ``[R, vocab_size]``, True where the int32 bitmask ``[R, ceil(vocab / 32)]``
    forbids the token (bit ``t % 32`` of word ``t // 32`` allows token t)."""
    bits = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].view(bool)


def mask_rows(logits: torch.Tensor, rows: list[int], banned: np.ndarray) -> None:
    """Set ``logits[rows[k]]`` to -inf where ``banned[k]``, in place, other rows untouched.

    On the CPU this runs in numpy, one row at a time, on this thread: a torch op per row
    starts an OpenMP region each, and on a busy 2-core machine those cost ~16 ms apiece
    (0.5 ms here for 16 rows of 49152, against 256 ms with torch's two threads). On a
    GPU it is one gather, fill and scatter."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        for k, row in enumerate(rows):
            np.copyto(values[row], -np.inf, where=banned[k])
        return
    index = torch.tensor(rows, device=logits.device)
    mask = torch.from_numpy(banned).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(mask, float("-inf"))


class GrammarStep:
    """The constrained sampling rows of one step.

    ``positions[i]`` is the index, among the step's sampling states, of the i-th
    constrained one; ``drafts[i]`` its drafts (speculative decoding; empty otherwise).
    A state with k drafts owns k+1 consecutive logits rows, and the constrained one
    owns as many bitmask rows, in the same order::

        logits rows     s0 | s1 s1 s1 | s2 s2          (s1: 2 drafts, s2: 1)
        constrained         s1          s2
        bitmask rows        0  1  2     3  4           (starts[i]: 0, 3)
    """

    def __init__(self, positions: list[int], grammars: list[RequestGrammar],
                 drafts: list[list[int]], bitmask: np.ndarray, executor: ThreadPoolExecutor):
        self.positions, self.grammars, self.drafts = positions, grammars, drafts
        self.bitmask = bitmask
        self.starts = np.cumsum([0] + [len(d) + 1 for d in drafts])[:-1].tolist()
        self.deferred_req_ids: list[str] = []
        self.ended_req_ids: list[str] = []  # EOS where only EOS was allowed (accept)
        self._filled: Future = executor.submit(self._fill_ready)

    def _fill(self, i: int) -> None:
        self.grammars[i].fill_drafts(self.bitmask, self.starts[i], self.drafts[i])

    def _fill_ready(self) -> list[bool]:
        filled = []
        for i, grammar in enumerate(self.grammars):
            ready = grammar.is_ready
            if ready:
                self._fill(i)
            filled.append(ready)
        return filled

    def apply(self, logits: torch.Tensor, states: list[CachedRequestState]
              ) -> tuple[torch.Tensor, list[CachedRequestState]]:
        """Mask the constrained rows of ``logits`` (in place; ``len(s.spec_token_ids)
        + 1`` rows per state, in ``states`` order); returns the logits and states that
        sample this step (deferred states and their rows removed)."""
        filled = self._filled.result()
        owned = np.cumsum([0] + [len(s.spec_token_ids) + 1 for s in states]).tolist()
        mask_rows_of, logits_rows, deferred = [], [], set()
        for i, (grammar, was_filled) in enumerate(zip(self.grammars, filled)):
            if not was_filled and grammar.is_ready:  # compiled during the forward
                self._fill(i)
                was_filled = True
            n = len(self.drafts[i]) + 1
            if was_filled:
                mask_rows_of.extend(range(self.starts[i], self.starts[i] + n))
                logits_rows.extend(range(owned[self.positions[i]],
                                         owned[self.positions[i]] + n))
            else:
                deferred.add(self.positions[i])
                self.deferred_req_ids.append(grammar.req_id)
        if mask_rows_of:
            mask_rows(logits, logits_rows,
                      disallowed_tokens(self.bitmask[mask_rows_of], logits.shape[-1]))
        if not deferred:
            return logits, states
        keep = [p for p in range(len(states)) if p not in deferred]
        keep_rows = [r for p in keep for r in range(owned[p], owned[p + 1])]
        self._drop(deferred)
        return logits[keep_rows], [states[p] for p in keep]

    def _drop(self, deferred: set[int]) -> None:
        """Forget deferred states (they sample nothing, so ``accept`` must skip them)."""
        kept = [i for i, p in enumerate(self.positions) if p not in deferred]
        # positions renumbered to indices among the kept states
        self.positions = [self.positions[i] - sum(d < self.positions[i] for d in deferred)
                          for i in kept]
        self.grammars = [self.grammars[i] for i in kept]
        self.drafts = [self.drafts[i] for i in kept]

    def accept(self, token_ids: list[list[int]]) -> None:
        """Advance each constrained state's matcher by the tokens it emitted
        (``token_ids[p]``: state p's, among the states ``apply`` kept)."""
        for position, grammar in zip(self.positions, self.grammars):
            grammar.accept(token_ids[position])
            if grammar.ended_at_eos:
                self.ended_req_ids.append(grammar.req_id)
