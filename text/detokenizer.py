"""Streaming token ids → text deltas, with stop strings, at constant cost per token.

Decoding only the new token is wrong twice over: a character may be split across tokens
(an emoji is often three byte-level tokens, each alone an invalid UTF-8 fragment), and
SentencePiece-style decoders drop the leading space of the first token they see. So each
step decodes a short window of recent ids and releases only what is new and complete::

    ids:   ... | window_start ................................. len(ids) |
    text = decode(ids[window_start:])
           |<---- num_emitted chars ---->|<-- new, complete -->|<- U+FFFD tail ->|
                (context or already out)      released now       held: the last
                                                                 character may be
                                                                 incomplete

A trailing run of U+FFFD may be an incomplete character, so it waits for the next ids
(``finish`` releases it as is). The text before it can no longer change, because later
bytes only extend the byte string. Once the window's text is complete it slides forward,
keeping a few ids of context, so each decode sees a handful of ids however long the
output grows.

Stop strings: text that could still be the start of a stop string is held back until
the next tokens decide it. Held-back text plus new text is the only place a stop can
complete (anything released earlier was, by construction, not a stop prefix), so each
step searches just that short tail.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from text.stop_prefix import StopPrefixes

# Ids kept as decoding context in front of new ones (prompt tail at the start).
CONTEXT_TOKENS = 5
# The window slides once it holds this many ids and its text is complete.
SLIDE_AT_TOKENS = 12
# A window still incomplete at this size holds invalid bytes, not a character being
# spelled out; it slides anyway so that decoding cost stays bounded.
MAX_WINDOW_TOKENS = 64
REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True, frozen=True)
class DetokenizedDelta:
    """Text released by one update, and whether a stop string ended the request."""

    text: str
    is_stopped: bool = False  # a stop string matched; the request should finish
    stop_str: str | None = None  # which stop string matched


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas; see the module docstring."""

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in (stop or []) if s]
        self._stop_prefixes = StopPrefixes(self._stops)  # what to hold back
        self._include_stop = include_stop_str_in_output
        # stop strings end the output only in tokens after the first min_tokens (vLLM's
        # rule; the engine holds back stop ids and EOS as long)
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._window_start = 0
        # The prompt's text counts as emitted: only output text is ever released.
        self._num_emitted = len(self._decode_window())
        self._pending_text = ""  # decoded but held back (could begin a stop string)
        self._output_text = ""
        self.is_stopped = False
        self.stop_str: str | None = None
        self._is_finished = False

    @property
    def output_text(self) -> str:
        """All text released so far (held-back text is not included until released)."""
        return self._output_text

    def update(self, new_token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add sampled ids; return the text they release (possibly empty)."""
        if self.is_stopped or self._is_finished:
            return DetokenizedDelta("", self.is_stopped, self.stop_str)
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        return self._advance(self._decode_new_text(force=False), final=False)

    def finish(self) -> DetokenizedDelta:
        """End of generation: flush incomplete characters and held-back text. Later calls
        to update() or finish() release nothing."""
        if self.is_stopped or self._is_finished:
            return DetokenizedDelta("", self.is_stopped, self.stop_str)
        self._is_finished = True
        return self._advance(self._decode_new_text(force=True), final=True)

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self._ids[self._window_start:], self._skip_special_tokens)

    def _decode_new_text(self, force: bool) -> str:
        text = self._decode_window()
        tail = text[self._num_emitted:]
        ready = tail if force else tail.rstrip(REPLACEMENT_CHAR)
        self._num_emitted += len(ready)
        num_held = len(tail) - len(ready)
        window = len(self._ids) - self._window_start
        if not force and ((num_held == 0 and window >= SLIDE_AT_TOKENS)
                          or window >= MAX_WINDOW_TOKENS):
            self._slide(num_held)
        return ready

    def _slide(self, num_held: int) -> None:
        # Restart the window CONTEXT_TOKENS ids back. All of its text has been released
        # except the last num_held characters; a window that starts inside a character
        # shows U+FFFD for the orphaned bytes, which count as released.
        self._window_start = len(self._ids) - CONTEXT_TOKENS
        self._num_emitted = max(0, len(self._decode_window()) - num_held)
        if self._window_start > 4 * SLIDE_AT_TOKENS:  # drop ids no window will read again
            del self._ids[:self._window_start]
            self._window_start = 0

    def _advance(self, new_text: str, final: bool) -> DetokenizedDelta:
        text = self._pending_text + new_text
        match = self._find_stop(text, len(self._pending_text)) \
            if self._num_output_tokens > self._min_tokens else None
        if match is not None:
            index, stop = match
            released = text[:index + len(stop)] if self._include_stop else text[:index]
            self._pending_text = ""
            self.is_stopped, self.stop_str = True, stop
            return DetokenizedDelta(self._release(released), True, stop)
        keep = 0 if final else self._stop_prefixes.feed(new_text)
        self._pending_text = text[len(text) - keep:] if keep else ""
        return DetokenizedDelta(self._release(text[:len(text) - keep]))

    def _release(self, text: str) -> str:
        self._output_text += text
        return text

    def _find_stop(self, text: str, num_held: int) -> tuple[int, str] | None:
        """Earliest stop string occurrence in ``text`` that ends past its first
        ``num_held`` characters, the held-back text (the longest one on a tie). One
        inside the held-back text alone came before min_tokens, or it would have ended
        the output already."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop, max(0, num_held - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]
                               or (index == best[0] and len(stop) > len(best[1]))):
                best = (index, stop)
        return best

