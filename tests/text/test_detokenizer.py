"""Incremental detokenization: streaming equals full decode, whole characters, stop strings."""
from __future__ import annotations

import pytest

from text.detokenizer import DetokenizedDelta, IncrementalDetokenizer

TEXTS = [
    "Hello world! This is a plain sentence.",
    "emoji 😀👍🏽 flags 🇫🇷 family 👨‍👩‍👧 and 日本語 text",
    "def f(x):\n    return x * 12345\n\n\tdone",
    "café — naïve ∑ ≠ ∞, 3.14159",
    "日本語のテキストは、とても長い文章です。中文也可以。한국어도 됩니다. 🇯🇵🇰🇷👍🏽👍🏾",
]
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


def _stream(detokenizer, ids):
    deltas = [detokenizer.update([token]) for token in ids]
    return deltas + [detokenizer.finish()]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_one_token_at_a_time_equals_full_decode(smollm_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, smollm_tokenizer.encode(PROMPT))
    deltas = _stream(detokenizer, ids)
    assert "".join(d.text for d in deltas) == smollm_tokenizer.decode(ids) == text
    assert detokenizer.output_text == text
    assert not any("\ufffd" in d.text for d in deltas)
    assert not any(d.is_stopped for d in deltas)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_several_tokens_per_update(smollm_tokenizer, chunk):
    for text in TEXTS:
        ids = smollm_tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(smollm_tokenizer, [])
        deltas = [detokenizer.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        deltas.append(detokenizer.finish())
        assert "".join(d.text for d in deltas) == text
        assert not any("\ufffd" in d.text for d in deltas)


def test_emoji_split_across_byte_tokens_comes_out_whole(smollm_tokenizer):
    ids = smollm_tokenizer.encode("😀")
    # The emoji really is split: alone, its first token is an incomplete UTF-8 sequence.
    assert len(ids) > 1 and smollm_tokenizer.decode(ids[:1]).endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, smollm_tokenizer.encode("Hi "))
    texts = [d.text for d in _stream(detokenizer, ids)]
    assert texts[:len(ids) - 1] == [""] * (len(ids) - 1)
    assert texts[len(ids) - 1] == "😀"


def test_stop_string_straddling_two_deltas_is_trimmed(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hello world, how are you?")
    assert smollm_tokenizer.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [], stop=["lo wor"])
    first = detokenizer.update(ids[:1])
    assert first == DetokenizedDelta("Hel")  # "lo" is held back: it may start the stop
    second = detokenizer.update(ids[1:2])
    assert second == DetokenizedDelta("", is_stopped=True, stop_str="lo wor")
    assert detokenizer.output_text == "Hel"
    assert detokenizer.update(ids[2:3]) == DetokenizedDelta("", True, "lo wor")
    assert detokenizer.finish().is_stopped and detokenizer.output_text == "Hel"


def test_include_stop_str_in_output(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hello world, how are you?")
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [], stop=["lo wor"],
                                         include_stop_str_in_output=True)
    deltas = _stream(detokenizer, ids)
    assert "".join(d.text for d in deltas) == "Hello wor"
    assert detokenizer.output_text == "Hello wor" and detokenizer.stop_str == "lo wor"


def test_stop_at_the_very_first_token(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hello world")
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, smollm_tokenizer.encode(PROMPT),
                                         stop=["Hello"])
    assert detokenizer.update(ids[:1]) == DetokenizedDelta("", True, "Hello")
    assert detokenizer.output_text == ""


def test_earliest_stop_wins_and_prefix_that_never_completes_is_released(smollm_tokenizer):
    ids = smollm_tokenizer.encode("one two three four")
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [], stop=["four", "two t", "onex"])
    deltas = _stream(detokenizer, ids)
    assert "".join(d.text for d in deltas) == "one "
    assert detokenizer.stop_str == "two t"


def test_finish_flushes_held_back_text(smollm_tokenizer):
    ids = smollm_tokenizer.encode("The end is x")
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [], stop=["xyz"])
    streamed = "".join(detokenizer.update([t]).text for t in ids)
    assert streamed == "The end is "  # "x" could still become "xyz"
    final = detokenizer.finish()
    assert final == DetokenizedDelta("x") and detokenizer.output_text == "The end is x"


def test_special_tokens_skipped_or_kept(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hi<|im_end|>")
    skipping = IncrementalDetokenizer(smollm_tokenizer, [])
    assert "".join(d.text for d in _stream(skipping, ids)) == "Hi"
    keeping = IncrementalDetokenizer(smollm_tokenizer, [], skip_special_tokens=False)
    assert "".join(d.text for d in _stream(keeping, ids)) == "Hi<|im_end|>"


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, inner):
        self.inner, self.window_sizes = inner, []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def test_work_per_token_stays_constant(smollm_tokenizer):
    counting = _CountingTokenizer(smollm_tokenizer)
    ids = smollm_tokenizer.encode(" ".join(TEXTS) * 20)
    specials = [1, 2] * 20  # ids that decode to nothing must not grow the window either
    detokenizer = IncrementalDetokenizer(counting, list(range(1000)), stop=["never-said"])
    stream = ids + specials + ids[:50]
    for token in stream:
        detokenizer.update([token])
    assert len(ids) > 1000
    assert max(counting.window_sizes) <= 16
    assert len(detokenizer._ids) <= 64  # old ids are dropped, not kept forever
    detokenizer.finish()
    assert detokenizer.output_text == smollm_tokenizer.decode(stream)


def test_invalid_bytes_do_not_stall_the_stream(smollm_tokenizer):
    # A lone UTF-8 lead byte followed by ASCII can never complete: it is released as
    # U+FFFD together with the text after it, not held until the end.
    lead_byte = smollm_tokenizer.encode("😀")[0]
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [])
    assert detokenizer.update([lead_byte]).text == ""
    assert detokenizer.update(smollm_tokenizer.encode(" ok")).text == "\ufffd ok"


def test_trailing_incomplete_bytes_are_flushed_by_finish(smollm_tokenizer):
    lead_byte = smollm_tokenizer.encode("😀")[0]
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [])
    assert detokenizer.update(smollm_tokenizer.encode("ok") + [lead_byte]).text == "ok"
    assert detokenizer.finish().text == "\ufffd"
    assert detokenizer.update(smollm_tokenizer.encode("more")).text == ""
    assert detokenizer.output_text == "ok\ufffd"


def test_a_long_run_of_incomplete_windows_stays_bounded(smollm_tokenizer):
    counting = _CountingTokenizer(smollm_tokenizer)
    lead_byte = smollm_tokenizer.encode("😀")[0]
    detokenizer = IncrementalDetokenizer(counting, [])
    for _ in range(300):
        detokenizer.update([lead_byte])
    assert max(counting.window_sizes) <= 70
    assert detokenizer.finish().text.startswith("\ufffd")


@pytest.mark.parametrize("min_tokens, released, stop_str", [
    (0, "one ", "two"),  # the first "two" (token 2) ends it
    (1, "one ", "two"),
    (2, "one two three ", "two"),  # token 2 is not past min_tokens; token 4 is
    (4, "one two three two ", "four"),
    (5, "one two three two four ", "five"),
])
def test_stop_strings_wait_for_min_tokens(smollm_tokenizer, min_tokens, released, stop_str):
    ids = smollm_tokenizer.encode("one two three two four five six", add_special_tokens=False)
    assert smollm_tokenizer.convert_ids_to_tokens(ids)[:5] == ["one", "Ġtwo", "Ġthree",
                                                                "Ġtwo", "Ġfour"]
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [], stop=["two", "four", "five"],
                                         min_tokens=min_tokens)
    deltas = _stream(detokenizer, ids)
    assert "".join(d.text for d in deltas) == released
    assert detokenizer.stop_str == stop_str


def test_a_stop_inside_text_held_before_min_tokens_is_not_found_later(smollm_tokenizer):
    # "ab" completes inside text held back for "xabq" before min_tokens; the next token
    # must not end the output on it
    ids = smollm_tokenizer.encode("xab zz", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [], stop=["ab", "xabq"],
                                         min_tokens=2)
    deltas = _stream(detokenizer, ids)
    assert "".join(d.text for d in deltas) == "xab zz" and not detokenizer.is_stopped
