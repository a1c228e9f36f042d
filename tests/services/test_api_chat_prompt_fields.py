"""Issue 18: the chat fields that shape the prompt, on chat completions and on
``/tokenize``: ``continue_final_message`` (the final message left open, vLLM's
semantics), ``add_generation_prompt``, ``tools`` (rendered by templates that know them)
and ``return_token_strs``. The API process and the default model's tokenizer are real;
the engine is the harness's fake, which records the prompt ids that reached it."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.services.api_harness import api_server
from text.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
PREFILLED = [{"role": "user", "content": "Tell me a story"},
             {"role": "assistant", "content": "Once upon"}]
END_OF_TURN = "<|im_end|>\n"  # what SmolLM2's ChatML template writes after a message


async def _post(s, url, path, body):
    async with s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_continue_final_message_leaves_the_last_message_open(smollm_tokenizer):
    closed = smollm_tokenizer.apply_chat_template(PREFILLED, add_generation_prompt=False)
    assert closed.endswith("Once upon" + END_OF_TURN)
    expected = _ids(smollm_tokenizer, closed.removesuffix(END_OF_TURN))

    async def main():
        async with api_server(smollm_tokenizer, max_model_len=512) as (url, engine):
            async with aiohttp.ClientSession() as s:
                for extra in ({"continue_final_message": True},  # generation prompt off
                              {"continue_final_message": True, "add_generation_prompt": False}):
                    status, body = await _post(s, url, CHAT, {
                        "model": "folio-tiny", "messages": PREFILLED, "max_tokens": 2, **extra})
                    assert status == 200, body
                status, tok = await _post(s, url, "/tokenize", {
                    "messages": PREFILLED, "continue_final_message": True,
                    "add_generation_prompt": False})
                assert status == 200, tok
                # without it, the same conversation ends its turn and opens a new one
                status, body = await _post(s, url, CHAT, {"model": "folio-tiny",
                                                          "messages": PREFILLED, "max_tokens": 2})
                assert status == 200
        return engine.added, tok
    added, tok = asyncio.run(main())
    assert added[0][1] == expected and added[1][1] == expected and tok["tokens"] == expected
    opened = smollm_tokenizer.apply_chat_template(PREFILLED, add_generation_prompt=True)
    assert added[2][1] == _ids(smollm_tokenizer, opened) != expected


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_continue_final_message_refuses_a_generation_prompt_and_empty_content(
        smollm_tokenizer, path):
    async def main():
        async with api_server(smollm_tokenizer, max_model_len=512) as (url, engine):
            async with aiohttp.ClientSession() as s:
                both = await _post(s, url, path, {
                    "model": "folio-tiny", "messages": PREFILLED,
                    "continue_final_message": True, "add_generation_prompt": True})
                empty = await _post(s, url, path, {
                    "model": "folio-tiny", "continue_final_message": True,
                    "messages": [*PREFILLED[:1], {"role": "assistant", "content": " "}]})
            return both, empty, engine.added
    (s1, both), (s2, empty), added = asyncio.run(main())
    assert s1 == 400 and both["error"]["param"] == "continue_final_message", both
    assert s2 == 400 and "continue_final_message" in empty["error"]["message"], empty
    assert added == []


def test_tokenize_honours_add_generation_prompt_and_return_token_strs(smollm_tokenizer):
    messages = PREFILLED[:1]

    async def main():
        async with api_server(smollm_tokenizer, max_model_len=512) as (url, _):
            async with aiohttp.ClientSession() as s:
                return [await _post(s, url, "/tokenize", body) for body in (
                    {"messages": messages, "return_token_strs": True},
                    {"messages": messages, "add_generation_prompt": False},
                    {"prompt": "Hello world", "return_token_strs": True},
                    {"prompt": "Hello world", "return_token_strs": "yes"})]
    (s1, on), (s2, off), (s3, text), (s4, bad) = asyncio.run(main())
    assert s1 == s2 == s3 == 200
    assert on["tokens"] == _ids(smollm_tokenizer, smollm_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True))
    assert off["tokens"] == _ids(smollm_tokenizer, smollm_tokenizer.apply_chat_template(
        messages, add_generation_prompt=False))
    assert len(on["tokens"]) > len(off["tokens"]) and "token_strs" not in off
    assert on["token_strs"] == smollm_tokenizer.convert_ids_to_tokens(on["tokens"])
    assert on["token_strs"][-1] == "Ċ"  # the generation prompt ends with a newline
    assert text["token_strs"] == ["Hello", "Ġworld"] and text["count"] == 2
    assert s4 == 400 and bad["error"]["param"] == "return_token_strs"


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} "
                  "{{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object"}}}


def test_tokenize_renders_tools_for_templates_that_know_them(smollm_tokenizer):
    tokenizer = Tokenizer(smollm_tokenizer.backend, bos_token=smollm_tokenizer.bos_token,
                          eos_token=smollm_tokenizer.eos_token, chat_template=TOOLS_TEMPLATE)
    messages = PREFILLED[:1]

    async def main():
        async with api_server(tokenizer, max_model_len=512) as (url, _):
            async with aiohttp.ClientSession() as s:
                return [await _post(s, url, "/tokenize", body) for body in (
                    {"messages": messages, "tools": [TOOL]}, {"messages": messages},
                    {"messages": messages, "tools": [{"type": "function"}]})]
    (s1, with_tools), (s2, without), (s3, bad) = asyncio.run(main())
    assert s1 == s2 == 200
    assert with_tools["tokens"] == _ids(tokenizer, tokenizer.apply_chat_template(
        messages, tools=[TOOL]))
    assert "Tools: get_weather" in tokenizer.decode(with_tools["tokens"])
    assert without["tokens"] == with_tools["tokens"][-len(without["tokens"]):]
    assert s3 == 400 and bad["error"]["param"] == "tools"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_echo_with_continue_final_message_starts_the_reply_with_the_prefill(
        smollm_tokenizer, stream):
    """vLLM's pattern for prefilling a reply: ``echo`` + ``continue_final_message``
    answers with the final message's text followed by what the model added."""
    generated = smollm_tokenizer.decode([42] * 3)  # what the fake engine samples

    async def main():
        async with api_server(smollm_tokenizer, max_model_len=512) as (url, _):
            async with aiohttp.ClientSession() as s:
                body = {"model": "folio-tiny", "messages": PREFILLED, "max_tokens": 3,
                        "echo": True, "continue_final_message": True,
                        "add_generation_prompt": False, "stream": stream}
                async with s.post(url + CHAT, json=body) as r:
                    assert r.status == 200
                    if not stream:
                        return (await r.json())["choices"][0]["message"]["content"]
                    text = ""
                    async for line in r.content:
                        line = line.decode().strip()
                        if line.startswith("data: {"):
                            delta = json.loads(line[6:])["choices"][0]["delta"]
                            text += delta.get("content") or ""
                    return text
    assert asyncio.run(main()) == "Once upon" + generated
