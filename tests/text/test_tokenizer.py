"""The API tokenizer: SmolLM2 from its GGUF, HF folders, special tokens, chat templates."""
from __future__ import annotations

import subprocess
import sys

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from text.chat_template import ChatTemplateError
from text.gguf_tokenizer import GGUFTokenizerError, build_gguf_tokenizer
from text.tokenizer import Tokenizer
from tests.worker.gguf_factory import TinyModelSpec, write_tiny_gguf

PROSE = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; it's known for the Eiffel Tower!",
    "café naïve résumé — “quoted” text",
    "He said: 'I'll do it' and she'd agree.",
]
HARD = [
    "word   12345",
    "In 2024, 1,000,000 people paid $3.50 each (about 3.5e6).",
    "def f(x):\n    if x > 10:\n        return x * 2\n\treturn 0\n",
    "    leading spaces and trailing   ",
    "tabs\tand\r\nwindows line ends\n\n\nblank lines",
    "日本語のテキストと한국어, ελληνικά, русский",
    "emoji 😀👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧 done",
    "version 1.2.3-rc4 at 10:45:07 on 2024-12-31",
    "x=1;y=22;z=333;w=4444",
]
CORPUS = PROSE + HARD


def _smollm_reference_pipeline(transformers_tokenizer_dir) -> BackendTokenizer:
    """transformers' converted tokenizer with the pre-tokenizer SmolLM2 really uses."""
    reference = BackendTokenizer.from_file(str(transformers_tokenizer_dir / "tokenizer.json"))
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return reference


def test_whitespace_before_digits_stays_one_token(smollm_tokenizer):
    tokens = smollm_tokenizer.convert_ids_to_tokens(smollm_tokenizer.encode("word   12345"))
    assert tokens == ["word", "ĠĠĠ", "1", "2", "3", "4", "5"]


def test_every_digit_is_its_own_token(smollm_tokenizer):
    text = "In 2024, 1,000,000 people paid $3.50"
    tokens = smollm_tokenizer.convert_ids_to_tokens(smollm_tokenizer.encode(text))
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens and all(len(t) == 1 for t in digit_tokens)


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(smollm_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    assert smollm_tokenizer.decode(ids) == text


def test_equals_the_smollm2_reference_pipeline(smollm_tokenizer, transformers_tokenizer_dir):
    reference = _smollm_reference_pipeline(transformers_tokenizer_dir)
    for text in CORPUS:
        assert smollm_tokenizer.encode(text) == reference.encode(text).ids, text


def test_agrees_with_transformers_gguf_conversion_on_prose(smollm_tokenizer, transformers_tokenizer):
    for text in PROSE:
        ids = smollm_tokenizer.encode(text)
        assert ids == transformers_tokenizer(text).input_ids, text
        assert smollm_tokenizer.decode(ids) == transformers_tokenizer.decode(ids)
    assert smollm_tokenizer.bos_token == transformers_tokenizer.bos_token == "<|im_start|>"
    assert smollm_tokenizer.eos_token == transformers_tokenizer.eos_token == "<|im_end|>"


def test_hf_folder_tokenizer_equals_transformers(transformers_tokenizer_dir, transformers_tokenizer):
    ours = Tokenizer.from_model_path(transformers_tokenizer_dir)
    for text in CORPUS:
        assert ours.encode(text) == transformers_tokenizer(text).input_ids, text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert ours.apply_chat_template(messages) == transformers_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert Tokenizer.from_model_path(transformers_tokenizer_dir / "tokenizer.json").encode("hi") \
        == ours.encode("hi")


def test_special_tokens(smollm_tokenizer):
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = smollm_tokenizer.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm_tokenizer.decode(ids) == "user\nHi"
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm_tokenizer.bos_token_id == 1 and smollm_tokenizer.eos_token_id == 2
    assert smollm_tokenizer.eos_token_ids == (2,)
    assert {0, 1, 2} <= set(smollm_tokenizer.all_special_ids)
    assert smollm_tokenizer.vocab_size == 49152
    assert smollm_tokenizer.convert_ids_to_tokens(1) == "<|im_start|>"


def test_smollm2_adds_no_bos(smollm_tokenizer):
    # The GGUF says tokenizer.ggml.add_bos_token = false.
    assert smollm_tokenizer.encode("Hi") == smollm_tokenizer.encode("Hi", add_special_tokens=False)
    assert smollm_tokenizer.encode("Hi")[0] != smollm_tokenizer.bos_token_id


def _tiny_vocab(**extra):
    tokens = ["<s>", "</s>", "<|im_end|>", "<tool>", "a", "b", "ab", "Ġ", "Ġab"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b", "Ġ ab"],
            "tokenizer.ggml.token_type": [3, 3, 3, 4, 1, 1, 1, 1, 1],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, **extra}


def test_gguf_add_bos_token_is_honoured(tmp_path):
    spec = TinyModelSpec(extra_metadata=_tiny_vocab(**{"tokenizer.ggml.add_bos_token": True}))
    write_tiny_gguf(tmp_path / "t.gguf", spec)
    tokenizer = Tokenizer.from_model_path(tmp_path / "t.gguf")
    assert tokenizer.encode("ab ab") == [0, 6, 8]
    assert tokenizer.encode("ab ab", add_special_tokens=False) == [6, 8]
    assert tokenizer.decode([0, 6, 8]) == "ab ab"


def test_user_defined_tokens_are_matched_but_not_special():
    parts = build_gguf_tokenizer(_tiny_vocab())
    tokenizer = Tokenizer(parts.tokenizer, bos_token=parts.bos_token, eos_token=parts.eos_token)
    assert tokenizer.encode("ab<tool>ab") == [6, 3, 6]
    assert tokenizer.decode([6, 3, 1]) == "ab<tool>"
    assert 3 not in tokenizer.all_special_ids and {0, 1, 2} <= set(tokenizer.all_special_ids)


def test_chatml_end_of_turn_joins_eos_ids():
    parts = build_gguf_tokenizer(_tiny_vocab(**{"tokenizer.chat_template":
                                                "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"}))
    tokenizer = Tokenizer(parts.tokenizer, bos_token=parts.bos_token, eos_token=parts.eos_token,
                          chat_template=parts.chat_template)
    assert tokenizer.eos_token_ids == (1, 2)
    plain = Tokenizer(parts.tokenizer, eos_token=parts.eos_token, extra_eos_token_ids=[3])
    assert plain.eos_token_ids == (1, 3)


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "llama"}, "'llama' is not supported"),
    ({"tokenizer.ggml.pre": "made-up"}, "'made-up' is not supported"),
])
def test_unknown_gguf_tokenizers_fail_clearly(change, message):
    with pytest.raises(GGUFTokenizerError, match=message):
        build_gguf_tokenizer(_tiny_vocab(**change))


@pytest.mark.parametrize("pre, expected", [
    # Llama 3 / Qwen2: punctuation keeps its trailing newlines, digits in runs of <= 3 / 1.
    ("llama-bpe", ["Hello", "Ġ", "123", "45", "Ġworld", "!!ĊĊ", "ĠĠ", "Ġx"]),
    ("qwen2", ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "!!ĊĊ", "ĠĠ", "Ġx"]),
    # GPT-2: a space joins the number; whitespace runs leave one space for the next word.
    ("gpt-2", ["Hello", "Ġ12345", "Ġworld", "!!", "ĊĊĠĠ", "Ġx"]),
    ("smollm", ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "!!", "ĊĊĠĠ", "Ġx"]),
])
def test_pre_tokenizer_splits(pre, expected):
    parts = build_gguf_tokenizer(_tiny_vocab(**{"tokenizer.ggml.pre": pre}))
    pieces = parts.tokenizer.pre_tokenizer.pre_tokenize_str("Hello 12345 world!!\n\n   x")
    assert [piece for piece, _ in pieces] == expected


# --- chat templates ----------------------------------------------------------------------

def test_chat_template_system_and_user(smollm_tokenizer):
    prompt = smollm_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}])
    assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                      "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_default_system_and_no_generation_prompt(smollm_tokenizer):
    prompt = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                  add_generation_prompt=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_accepts_text_parts(smollm_tokenizer):
    prompt = smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert "<|im_start|>user\nab<|im_end|>" in prompt


@pytest.mark.parametrize("messages, message", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\].role"),
    ([{"role": "user"}], "has no 'content'"),
    ([{"role": "assistant"}], "has no 'content'"),
    ([{"role": "assistant", "tool_calls": []}], "has no 'content'"),
    ([{"role": "user", "tool_calls": [{"id": "c"}]}], "has no 'content'"),
    ([{"role": "user", "content": 3}], "string or a list"),
    ([{"role": "user", "content": None}], "null"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "text parts"),
])
def test_malformed_messages_are_refused(smollm_tokenizer, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        smollm_tokenizer.apply_chat_template(messages)


def test_assistant_tool_calls_may_omit_content(smollm_tokenizer):
    # what a client that drops None fields sends back in an agent loop (OpenAI accepts it)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}
    turns = [{"role": "user", "content": "What is 2+2?"}, None,
             {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    omitted = smollm_tokenizer.apply_chat_template(
        [turns[0], {"role": "assistant", "tool_calls": [call]}, turns[2]])
    null = smollm_tokenizer.apply_chat_template(
        [turns[0], {"role": "assistant", "content": None, "tool_calls": [call]}, turns[2]])
    assert omitted == null and "<|im_start|>tool\n4<|im_end|>" in omitted


def _with_template(template: str) -> Tokenizer:
    parts = build_gguf_tokenizer(_tiny_vocab())
    return Tokenizer(parts.tokenizer, bos_token=parts.bos_token, eos_token=parts.eos_token,
                     chat_template=template)


def test_template_helpers_and_variables():
    # trim_blocks eats the newline after each block tag, lstrip_blocks the indentation
    # before one; without them the output would carry stray newlines and spaces.
    tokenizer = _with_template(
        "{{ bos_token }}{% if tools %}{{ tools | tojson }}{% endif %}\n"
        "{% for m in messages %}\n"
        "    {% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
        "[{{ m.role }}] {{ m.content }}\n"
        "{% endfor %}{{ eos_token }}")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hé"}],
                                             tools=[{"name": "f", "desc": "ü"}])
    assert rendered == '<s>[{"name": "f", "desc": "ü"}][user] hé\n</s>'
    with pytest.raises(ChatTemplateError, match="no tools here"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_templates_are_sandboxed():
    tokenizer = _with_template("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_broken_templates():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _with_template("").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _with_template("{% for m in messages %}")


def test_tokenizer_module_imports_neither_torch_nor_transformers():
    code = ("import sys, text.tokenizer, text.detokenizer;"
            "bad = {'torch', 'transformers', 'aiohttp'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
