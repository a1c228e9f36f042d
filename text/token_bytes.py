"""Each token's own bytes, as chat logprobs' ``bytes`` field carries them.

OpenAI's ``bytes`` exists so that a client can join the bytes of consecutive tokens into
characters that no single token holds whole (an emoji is often three byte-level
tokens). Decoding a lone token cannot give them: its incomplete UTF-8 comes out as
U+FFFD. So the bytes are read from the vocabulary entry itself:

- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): each symbol of the entry stands for
  one byte (text/token_span.py's ``byte_symbols``);
- SentencePiece with byte fallback (Llama 2, Mistral): an entry ``<0xE2>`` is that byte,
  any other is its text with ``▁`` as a space;
- added and special tokens, and any other tokenizer: the token's text in UTF-8.
"""
from __future__ import annotations

import re

from tokenizers import Tokenizer as BackendTokenizer

from text.token_span import byte_symbols, component_types

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


class TokenBytes:
    """``token_bytes(token_id)``: the bytes one token stands for (cached per id)."""

    def __init__(self, backend: BackendTokenizer):
        self._backend = backend
        decoders = component_types(backend.decoder)
        self._byte_level = "ByteLevel" in decoders
        self._byte_fallback = "ByteFallback" in decoders
        self._byte_of = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
        self._added = {index: token.content
                       for index, token in backend.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._backend.id_to_token(token_id)
        if piece is None:  # an id past the vocabulary (a padded logits row)
            return b""
        if self._byte_level and all(symbol in self._byte_of for symbol in piece):
            return bytes(self._byte_of[symbol] for symbol in piece)
        if self._byte_fallback:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace(SENTENCEPIECE_SPACE, " ").encode()
        return self._backend.decode([token_id], skip_special_tokens=False).encode()
