"""Prompt-lookup (n-gram) drafts for a whole batch at once, with numpy.

For each request: take the longest n-gram that ends its tokens (``max_n`` down to
``min_n`` tokens) and also occurs earlier in them; propose the k tokens that followed
its latest earlier occurrence that has k tokens after it (else its latest)::

    tokens    a b c d x   y a b c d   z q a b c
                  ^^^^^             ~~~~~ suffix "a b c" (n = 3)
    earlier "a b c" end at 2 and 9; the later one wins: propose "d z q" (k = 3)

The batch is one flat array. Pass 0 finds, in one numpy pass over all of it, the
positions holding a copy of their request's last token: where an earlier n-gram can
end. Pass j (j = 1 .. max_n-1) keeps those candidates whose token j places back still
equals the suffix's; a candidate's run length is the number of passes it survived.
No pass loops over tokens in Python; a per-request max of one score picks the match.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_core.request import Request


@dataclass(slots=True)
class _TokenMirror:
    """A request's token ids as a growing numpy array (appended to, never rebuilt)."""

    array: np.ndarray
    length: int = 0


class NgramProposer:
    """Proposes up to k draft tokens per request by prompt lookup."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._mirrors: dict[str, _TokenMirror] = {}

    def forget(self, req_id: str) -> None:
        """Drop a finished request's mirror."""
        self._mirrors.pop(req_id, None)

    def _tokens(self, request: Request) -> np.ndarray:
        tokens = request.all_token_ids  # append-only, so the mirror only catches up
        mirror = self._mirrors.get(request.req_id)
        if mirror is None or len(mirror.array) < len(tokens):
            array = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
            if mirror is not None:
                array[:mirror.length] = mirror.array[:mirror.length]
            mirror = self._mirrors[request.req_id] = _TokenMirror(
                array, mirror.length if mirror is not None else 0)
        if mirror.length < len(tokens):
            mirror.array[mirror.length:len(tokens)] = tokens[mirror.length:]
            mirror.length = len(tokens)
        return mirror.array[:mirror.length]

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """At most ``num_drafts[i]`` draft tokens for ``requests[i]`` (none: no match)."""
        if not requests:
            return []
        arrays = [self._tokens(r) for r in requests]
        lens = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays)
        ends = np.cumsum(lens)
        starts = ends - lens
        k = np.asarray(num_drafts, dtype=np.int64)
        end_rel = self._match_ends(flat, starts, ends, lens, k)  # -1: no match
        width = int(k.max()) if len(k) else 0
        offsets = np.arange(width)[None, :]
        take = starts[:, None] + end_rel[:, None] + 1 + offsets  # tokens after the match
        valid = (end_rel[:, None] >= 0) & (take < ends[:, None]) & (offsets < k[:, None])
        drafts = flat[np.where(valid, take, 0)]
        counts = valid.sum(axis=1).tolist()
        return [row[:n] for row, n in zip(drafts.tolist(), counts)]

    def _match_ends(self, flat: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                    lens: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Per request, where (relative to its start) the chosen earlier n-gram ends."""
        # Pass 0 over the whole batch: a match ends on a copy of the request's last
        # token, before that token itself (so that a token follows it).
        is_end = flat == np.repeat(flat[ends - 1], lens)
        is_end[ends - 1] = False
        cand = np.flatnonzero(is_end)  # few: the later passes only look at these
        seg = np.searchsorted(ends, cand, side="right")
        rel = cand - starts[seg]
        run = np.ones(len(cand), dtype=np.int64)
        alive = np.ones(len(cand), dtype=bool)
        for j in range(1, self.max_n):
            back = ends[seg] - 1 - j  # the suffix's token j places before its end
            alive &= (rel >= j) & (back >= starts[seg])
            alive &= flat[np.maximum(cand - j, 0)] == flat[np.maximum(back, 0)]
            if not alive.any():
                break
            run += alive
        # Longest run first, then as many followers as wanted (up to k), then the
        # latest: one integer orders all three (rel < T + 1, followers <= k <= K).
        span = len(flat) + 1
        followers = np.minimum(lens[seg] - 1 - rel, k[seg])
        score = np.where(run >= self.min_n,
                         (run * (int(k.max()) + 1) + followers) * span + rel, -1)
        best = np.full(len(lens), -1, dtype=np.int64)
        np.maximum.at(best, seg, score)
        return np.where(best >= 0, best % span, -1)
