"""Issue 14, item 1: the cheap bound on a text's token count is never violated.

A server refuses a prompt when ``span.min_tokens(text)`` already exceeds the context, so
``len(encode(text)) >= span.min_tokens(text)`` must hold for every text, or a prompt
that fits would be refused. Checked on the default tokenizer over random mixtures of
the hardest characters (digits, whitespace runs, combining accents, CJK, emoji, bytes
missing from the vocabulary), and on small tokenizers built to break a naive bound.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from text.token_span import TokenSpan, max_composition, token_span

PIECES = ["0", "7", "12345", " ", "   ", "\n", "\t", "\r\n", " " * 80, "\n" + " " * 80,
          "#" * 40, "=" * 64, "e\u0301", "\u0301", "\u0301\u0302\u0303", "日本語", "한국어",
          "😀", "👍🏽", "👨‍👩‍👧", "\U00040000", "\U000B0001", "\x04", "\x16", "\x1d", "a",
          "word", "<|im_start|>", "<|im_end|>", "<", "|", "é", "\u3000"]
TEXTS = st.one_of(st.lists(st.sampled_from(PIECES), max_size=60).map("".join),
                  st.text(max_size=200))


def test_the_default_tokenizers_span(smollm_tokenizer):
    span = smollm_tokenizer.token_span
    assert span.max_chars == 81  # "\n" and 80 spaces is one token
    assert smollm_tokenizer.encode("\n" + " " * 80) == [46778]
    # six ASCII control bytes are not in SmolLM2's vocabulary: they vanish whole
    assert span.vanishing == "\x04\x06\x13\x14\x16\x1d"
    assert all(smollm_tokenizer.encode(c * 5) == [] for c in span.vanishing)
    assert span.min_tokens("\x16" * 10_000 + "a") == 1


@settings(max_examples=400, deadline=None, database=None)
@given(TEXTS)
def test_the_bound_holds_on_the_default_tokenizer(smollm_tokenizer, text):
    span = smollm_tokenizer.token_span
    assert len(smollm_tokenizer.encode(text, add_special_tokens=False)) >= \
        span.min_tokens(text)


def test_the_bound_holds_on_long_worst_case_runs(smollm_tokenizer):
    span = smollm_tokenizer.token_span
    for piece in ("\n" + " " * 80, " " * 64, "#" * 80, "\U00040000", "e\u0301", "0"):
        text = piece * (20_000 // len(piece))
        assert len(smollm_tokenizer.encode(text)) >= span.min_tokens(text) > 0


def _byte_level(normalizer=None, added=(), drop_continuation=False) -> BackendTokenizer:
    """A byte-level BPE whose only merge is "é" (C3 A9), with optional extras."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if drop_continuation:
        alphabet = [s for s in alphabet if s != "©"]  # byte 0xA9
    vocab = {s: i for i, s in enumerate(sorted(alphabet))}
    merges = [] if drop_continuation else [("Ã", "©")]
    if merges:
        vocab["Ã©"] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if normalizer is not None:
        backend.normalizer = normalizer
    if added:
        backend.add_special_tokens(list(added))
    return backend


def test_composition_multiplies_the_bound():
    backend = _byte_level(normalizers.NFC())
    span = token_span(backend)
    assert span.max_chars == max_composition() == 4
    text = "e\u0301" * 1000  # NFC makes each pair one "é": 1000 tokens for 2000 chars
    assert len(backend.encode(text).ids) == 1000 >= span.min_tokens(text)
    assert TokenSpan(1).min_tokens(text) == 2000  # without the factor: a false refusal
    assert token_span(_byte_level()).max_chars == 1


def test_tokenizers_without_a_sound_bound_get_none():
    assert token_span(_byte_level(normalizers.StripAccents())) is None
    assert token_span(_byte_level(added=[AddedToken("<x>", rstrip=True)])) is None
    assert token_span(_byte_level(drop_continuation=True)) is None  # a character may vanish
    wordpiece = BackendTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_span(wordpiece) is None
    span = token_span(_byte_level(added=[AddedToken("<|a_long_special_token|>")]))
    assert span.max_chars == len("<|a_long_special_token|>")
