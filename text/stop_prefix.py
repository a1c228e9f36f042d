"""How much of a request's output text could still begin a stop string.

The detokenizer holds back the longest suffix of the output that is a proper prefix of
one of its stop strings. Checking every length of every stop against the output's end
costs O(len(stop)^2) a token (a slice and a compare per length): 16 stops of 1,024
characters built to keep a long prefix open cost ~3 ms per sample per token, on the
API's event loop. Here each stop keeps a Knuth-Morris-Pratt state, the length of its
longest prefix the output ends with, and each new character moves it in amortised O(1).
"""
from __future__ import annotations


def borders(stop: str) -> list[int]:
    """KMP's failure function: ``borders(s)[i]`` is the length of the longest proper
    prefix of ``s[:i + 1]`` that is also its suffix."""
    out = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = out[k - 1]
        if stop[i] == stop[k]:
            k += 1
        out[i] = k
    return out


class StopPrefix:
    """One stop string's state over a stream of text fed to it piece by piece."""

    __slots__ = ("stop", "_borders", "state")

    def __init__(self, stop: str):
        self.stop = stop
        self._borders = borders(stop)
        self.state = 0  # the longest prefix of `stop` the text so far ends with

    def feed(self, text: str) -> int:
        """Extend the stream by ``text``; returns the new state. A whole occurrence of
        the stop is not reported (the detokenizer finds those with ``str.find``); the
        state then falls back to the stop's longest border, as KMP's matcher does."""
        stop, fail, s = self.stop, self._borders, self.state
        if s == 0:
            # a prefix that ends where the text ends starts in its last len(stop) - 1
            # characters, at a copy of the stop's first character (str.find: C speed)
            start = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            if start < 0:
                return 0
            text = text[start:]
        for c in text:
            while s and stop[s] != c:
                s = fail[s - 1]
            if stop[s] == c:
                s += 1
                if s == len(stop):
                    s = fail[s - 1]
        self.state = s
        return s


class StopPrefixes:
    """All of a request's stop strings: the most output text to hold back."""

    def __init__(self, stops: list[str]):
        self._stops = [StopPrefix(stop) for stop in stops]

    def feed(self, text: str) -> int:
        """Extend the output by ``text``; returns the length of its longest suffix that
        is a proper prefix of some stop string."""
        return max((stop.feed(text) for stop in self._stops), default=0)
