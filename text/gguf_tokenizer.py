"""Build a ``tokenizers.Tokenizer`` from the vocabulary a GGUF file carries.

A GGUF stores a byte-level BPE tokenizer as ``tokenizer.ggml.*`` keys: ``model`` ("gpt2"
for byte-level BPE), ``pre`` (which pre-tokenizer regex llama.cpp applies), ``tokens``,
``merges`` ("left right" strings), ``token_type`` (1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte) and the special ids. The pre-tokenizer is the part that
is easy to get wrong: llama.cpp keys it by name, so each name is mapped here to the split
rules the model was trained with (see ``PRE_TOKENIZERS``). An unknown name fails loudly,
because a near-miss pre-tokenizer silently changes token ids on a fraction of real text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4

# Llama 3's split: letters with one leading non-letter, digits in runs of up to three,
# punctuation runs with trailing newlines, newline runs, then whitespace.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's is Llama 3's with every digit on its own.
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer is missing or of a kind Folio cannot rebuild."""


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # The GPT-2 regex ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)
    # is what ByteLevel(use_regex=True) applies before mapping bytes to symbols.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # SmolLM/StarCoder: every digit is split out first, then the GPT-2 regex runs on the
    # pieces. Order matters: "word   12345" must give 'ĠĠĠ','1' (the spaces stay one
    # piece once the digits are cut away), not 'ĠĠ','Ġ1' as GPT-2's regex alone would.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _regex_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    return build


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    """How one ``tokenizer.ggml.pre`` name tokenizes: split rules and BPE options."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False  # whole-word vocabulary hits skip merging (Llama 3)
    nfc_normalize: bool = False  # Qwen2's tokenizer.json normalises to NFC first


PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec(_gpt2),
    "gpt-2": PreTokenizerSpec(_gpt2),
    "gpt2": PreTokenizerSpec(_gpt2),
    "smollm": PreTokenizerSpec(_digits_then_gpt2),
    "starcoder": PreTokenizerSpec(_digits_then_gpt2),
    "refact": PreTokenizerSpec(_digits_then_gpt2),
    "llama3": PreTokenizerSpec(_regex_then_bytes(LLAMA3_PATTERN), ignore_merges=True),
    "llama-v3": PreTokenizerSpec(_regex_then_bytes(LLAMA3_PATTERN), ignore_merges=True),
    "llama-bpe": PreTokenizerSpec(_regex_then_bytes(LLAMA3_PATTERN), ignore_merges=True),
    "qwen2": PreTokenizerSpec(_regex_then_bytes(QWEN2_PATTERN), nfc_normalize=True),
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizerParts:
    """The rebuilt tokenizer plus the facts the wrapper needs from the GGUF header."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    extra_eos_token_ids: tuple[int, ...]  # end-of-turn / end-of-message ids
    chat_template: str | None


def _token(tokens: list[str], metadata: dict[str, Any], key: str) -> str | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None or not 0 <= int(value) < len(tokens):
        return None
    return tokens[int(value)]


def _post_processor(bos: str | None, eos: str | None, add_bos: bool, add_eos: bool,
                    vocab: dict[str, int]) -> processors.PostProcessor | None:
    """Template that adds bos/eos when the GGUF asks for them (only with add_special_tokens)."""
    first = [bos] if add_bos and bos is not None else []
    last = [eos] if add_eos and eos is not None else []
    if not first and not last:
        return None
    single = first + ["$A"] + last
    pair = single + [f"{t}:1" for t in first] + ["$B:1"] + [f"{t}:1" for t in last]
    specials = [(token, vocab[token]) for token in dict.fromkeys(first + last)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_gguf_tokenizer(metadata: dict[str, Any]) -> GGUFTokenizerParts:
    """Rebuild the GGUF's byte-level BPE tokenizer; GGUFTokenizerError for other kinds."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') "
            f"is. Point model.tokenizer at the model's tokenizer.json instead")
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise GGUFTokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(PRE_TOKENIZERS)}); "
            f"point model.tokenizer at the model's tokenizer.json instead")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges))
    if spec.nfc_normalize:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = spec.build()
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, metadata)
    bos, eos = _token(tokens, metadata, "bos_token_id"), _token(tokens, metadata, "eos_token_id")
    post = _post_processor(bos, eos, bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                           bool(metadata.get("tokenizer.ggml.add_eos_token", False)), vocab)
    if post is not None:
        tokenizer.post_processor = post
    extra = tuple(int(metadata[f"tokenizer.ggml.{key}"]) for key in ("eot_token_id", "eom_token_id")
                  if metadata.get(f"tokenizer.ggml.{key}") is not None)
    return GGUFTokenizerParts(tokenizer, bos, eos, extra, metadata.get("tokenizer.chat_template"))


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], metadata: dict[str, Any]) -> None:
    # Control tokens (<|im_start|>, <|endoftext|>) are special: matched verbatim in input
    # text and dropped by decode(skip_special_tokens=True). User-defined tokens are matched
    # verbatim too, but are ordinary text when decoding.
    types = np.asarray(metadata.get("tokenizer.ggml.token_type", []))
    added = [AddedToken(tokens[i], special=bool(types[i] == CONTROL_TOKEN), normalized=False)
             for i in np.nonzero((types == CONTROL_TOKEN) | (types == USER_DEFINED_TOKEN))[0]]
    special = [token for token in added if token.special]
    plain = [token for token in added if not token.special]
    if special:
        tokenizer.add_special_tokens(special)
    if plain:
        tokenizer.add_tokens(plain)
