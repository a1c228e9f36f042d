"""``logprobs.text_offset``: where each token's text starts in the returned text.

Token i starts where the text released by tokens 0..i-1 ends. Decoding each token
alone is wrong for a character split across tokens (an emoji's bytes), so the offsets
come from the same incremental detokenizer that builds the text: a token that only
completes a character is placed after the text before it, and the next token after
that character. ``text[offset[i]:offset[i + 1]]`` is then token i's share of the text.
"""
from __future__ import annotations

from collections.abc import Sequence

from text.detokenizer import IncrementalDetokenizer


class TextOffsets:
    """Offsets of a stream of token ids, fed in pieces (``advance``) or at once."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, start: int = 0):
        self._detokenizer = IncrementalDetokenizer(tokenizer, context_ids,
                                                   skip_special_tokens=skip_special_tokens)
        self.position = start  # characters released so far (plus ``start``)

    def advance(self, token_ids: Sequence[int]) -> list[int]:
        """The offsets of these next tokens."""
        offsets = []
        for token_id in token_ids:
            offsets.append(self.position)
            self.position += len(self._detokenizer.update([token_id]).text)
        return offsets
