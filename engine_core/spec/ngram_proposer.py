"""Prompt-lookup (n-gram) drafts for a whole batch at once, with numpy.

For each request: take the longest n-gram that ends its tokens (``max_n`` down to
``min_n`` tokens) and also occurs earlier in them; propose the k tokens that followed
its latest earlier occurrence that has k tokens after it (else its latest)::

    tokens    a b c d x   y a b c d   z q a b c
                  ^^^^^             ~~~~~ suffix "a b c" (n = 3)
    earlier "a b c" end at 2 and 9; the later one wins: propose "d z q" (k = 3)

The batch is one flat array. Pass j (j = 0 .. max_n-1) keeps the positions whose run
of matches, read backwards, still equals the suffix j tokens back; a position's run
length is the number of passes it survived. One numpy pass per n-gram length, none
per token; a per-request max of one score then picks the match.
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
        num_tokens = len(flat)
        seg = np.repeat(np.arange(len(lens)), lens)
        rel = np.arange(num_tokens) - starts[seg]
        # back[r, j]: request r's token j places before its end (-1 before its start)
        back_pos = ends[:, None] - 1 - np.arange(self.max_n)[None, :]
        back = np.where(back_pos >= starts[:, None], flat[np.maximum(back_pos, 0)], -1)
        # A match must end before the last token, so that a token follows it.
        alive = rel < lens[seg] - 1
        run = np.zeros(num_tokens, dtype=np.int64)
        shifted = np.full(num_tokens, -2, dtype=flat.dtype)
        for j in range(self.max_n):
            if j == 0:
                shifted[:] = flat
            else:
                shifted[j:] = flat[:-j]
                shifted[:j] = -2
            alive &= (rel >= j) & (shifted == back[seg, j])
            if not alive.any():
                break
            run += alive
        # Longest run first, then as many followers as wanted (up to k), then the
        # latest: one integer orders all three (rel < T + 1, followers <= k <= K).
        span = num_tokens + 1
        followers = np.minimum(lens[seg] - 1 - rel, k[seg])
        score = np.where(run >= self.min_n,
                         (run * (int(k.max()) + 1) + followers) * span + rel, -1)
        best = np.maximum.reduceat(score, starts)
        return np.where(best >= 0, best % span, -1)
