"""How many characters of input text one token can stand for, at most.

With that number M, a text of C characters becomes at least ceil(C / M) tokens, so a
server can refuse a prompt that could never fit the context before tokenizing it
(tokenizing megabytes costs seconds). The bound must never be too small, or a prompt
that fits is refused; it is computed once from the vocabulary, and only where sound:

- Byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM): the pre-tokenizer maps each byte of
  the text to one of 256 symbols and BPE merges symbols into tokens, so the kept bytes
  are partitioned among the tokens. A byte whose symbol is not in the vocabulary is
  dropped (there is no unknown token): SmolLM2 lacks six ASCII control bytes, bytes
  valid UTF-8 never holds, and F1/F2 (lead bytes of planes 4-11). Count each character
  in the token holding its first kept byte. Decoding a token alone gives at least as
  many characters as it is counted: a complete character decodes to itself, and a
  character cut at the token's edge, or missing its dropped lead byte, leaves a lead
  byte or stray continuation bytes that start an ill-formed sequence, which decodes to
  at least one U+FFFD. So the longest single-token decode bounds every token. If every
  continuation byte (0x80-0xBF) is in the vocabulary, only ASCII characters can vanish
  whole; those are not counted (:attr:`TokenSpan.vanishing`).
- Added tokens (``<|im_start|>``...) are matched verbatim and cover their content;
  ones that also swallow neighbouring whitespace (``lstrip``/``rstrip``) cover
  unboundedly much: no bound.
- A normalizer runs first and may shorten the text. NFC/NFKC compose at most
  :func:`max_composition` code points into one (decomposing never shortens), so the
  bound is multiplied by that. Other normalizers may delete text: no bound.
- Other models (WordPiece, Unigram, BPE on characters) have unknown tokens that can
  stand for whole words or runs of characters: no bound.
"""
from __future__ import annotations

import functools
import json
import math
import sys
import unicodedata
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """The most characters one token covers, and the characters that yield no token."""

    max_chars: int
    vanishing: str = ""  # characters the tokenizer drops whole (their byte is unknown)

    def min_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can become (linear in C, no tokenization)."""
        num_chars = len(text) - sum(text.count(c) for c in self.vanishing)
        return math.ceil(num_chars / self.max_chars)


@functools.cache
def max_composition() -> int:
    """The most code points Unicode composition merges into one (4 in Unicode 15)."""
    return max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
               if not 0xD800 <= c <= 0xDFFF)


def component_types(component: Any) -> list[str]:
    """Component types of a normalizer, pre-tokenizer or decoder, Sequences flattened."""
    if component is None:
        return []
    state = json.loads(component.__getstate__()) if not isinstance(component, dict) \
        else component
    parts = state.get("normalizers") or state.get("pretokenizers") or state.get("decoders")
    return [t for part in parts for t in component_types(part)] if parts else [state["type"]]


def _normalizer_factor(backend: BackendTokenizer) -> int | None:
    kinds = component_types(backend.normalizer)
    if any(kind not in ("NFC", "NFKC", "NFD", "NFKD") for kind in kinds):
        return None
    composes = sum(kind in ("NFC", "NFKC") for kind in kinds)
    return max_composition() ** composes if composes else 1


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet, indexed by byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes, in order, for U+0100 onwards."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174]
    others = [b for b in range(256) if b not in printable]
    symbols = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [symbols[b] for b in range(256)]


def _vanishing_chars(backend: BackendTokenizer) -> str | None:
    """ASCII characters whose byte is not in the vocabulary; None when not byte-level BPE
    or when a continuation byte is missing too (a multi-byte character could vanish)."""
    if not isinstance(backend.model, models.BPE) or \
            "ByteLevel" not in component_types(backend.pre_tokenizer):
        return None
    vocab, symbols = backend.get_vocab(with_added_tokens=False), byte_symbols()
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()) or any(
            symbols[byte] not in vocab for byte in range(0x80, 0xC0)):
        return None
    return "".join(chr(byte) for byte in range(128) if symbols[byte] not in vocab)


def token_span(backend: BackendTokenizer) -> TokenSpan | None:
    """This tokenizer's :class:`TokenSpan`, or None where no sound bound exists (see the
    module docstring)."""
    factor, vanishing = _normalizer_factor(backend), _vanishing_chars(backend)
    if factor is None or vanishing is None:
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    ids = sorted(set(backend.get_vocab(with_added_tokens=True).values()))
    texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    longest = max([len(text) for text in texts] + [len(t.content) for t in added])
    return TokenSpan(max(longest, 1) * factor, vanishing)
