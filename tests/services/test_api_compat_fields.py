"""Issue 18, item "silently ignored fields": every OpenAI or vLLM request field Folio
knows either works or is a 400 naming it; a whole-number float for an integer field is
that integer (as vLLM reads it); a JSON body is read whatever its Content-Type says.

The API process is real; the engine is the harness's fake, which records what reached
it, so a refused field provably never reaches the engine.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from config.schema import APIConfig
from tests.services.api_harness import api_server

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
REFUSED = [  # (route, field, a value that asks for something not served)
    (CMPL, "suffix", "tail"), (CMPL, "best_of", 2), (CHAT, "tools", [{"type": "function"}]),
    (CHAT, "tool_choice", "required"), (CHAT, "continue_final_message", "yes"),
    (CMPL, "prompt_logprobs", -1), (CMPL, "truncate_prompt_tokens", 0),
    (CHAT, "truncation_side", "middle"), (CMPL, "return_token_ids", 1),
    (CHAT, "echo", "yes"), (CMPL, "logit_bias", {"49152": 1}),
]


def _body(path: str, **fields) -> dict:
    base = {"prompt": "Hello"} if path == CMPL else {"messages": HI}
    return {"model": "folio-tiny", **base, **fields}


async def _post(s, url, path, body, **kw):
    async with s.post(url + path, json=body, **kw) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("path,key,value", REFUSED, ids=[f"{k}" for _, k, _ in REFUSED])
def test_a_field_not_served_is_a_400_naming_it(smollm_tokenizer, path, key, value):
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                status, body = await _post(s, url, path, _body(path, **{key: value}))
            assert status == 400 and body["error"]["param"] == key, body
            assert key in body["error"]["message"]
            assert engine.added == []
    asyncio.run(main())


def test_whole_number_floats_are_integers_and_fractions_are_refused(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                status, body = await _post(s, url, CMPL, _body(
                    CMPL, seed=26915506.0, max_tokens=3.0, n=2.0, top_k=5.0))
                assert status == 200, body
                (_, _, params, _), = engine.added
                assert (params.seed, params.max_tokens, params.n, params.top_k) == (
                    26915506, 3, 2, 5)
                assert all(type(v) is int for v in (params.seed, params.max_tokens))
                for key, value in (("seed", 1.5), ("max_tokens", 2.25), ("n", 1e300)):
                    status, body = await _post(s, url, CMPL, _body(CMPL, **{key: value}))
                    assert status == 400 and body["error"]["param"] == key, body
    asyncio.run(main())


def test_a_json_body_is_read_whatever_its_content_type(smollm_tokenizer):
    """Decision (README): curl -d sends form-urlencoded and aiohttp's data=str text/plain;
    vLLM clients rely on neither, but refusing them breaks hand-written calls."""
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                for ctype in ("text/plain", "application/x-www-form-urlencoded"):
                    async with s.post(url + CMPL, data=json.dumps(_body(CMPL, max_tokens=2)),
                                      headers={"Content-Type": ctype}) as r:
                        assert r.status == 200, await r.text()
            assert len(engine.added) == 2
    asyncio.run(main())


def _events(raw: str) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.splitlines()
            if line.startswith("data: {")]


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                for path in (CMPL, CHAT):
                    opts = {"include_usage": True, "continuous_usage_stats": True}
                    async with s.post(url + path, json=_body(
                            path, max_tokens=4, stream=True, stream_options=opts)) as r:
                        events = _events(await r.text())
                    content = [e for e in events if e["choices"]
                               and e["choices"][0].get("delta", {}).get("role") is None]
                    assert content and all("usage" in e for e in content)
                    assert content[-1]["usage"]["completion_tokens"] == 4
                    assert events[-1]["usage"]["completion_tokens"] == 4
                async with s.post(url + CMPL, json=_body(CMPL, max_tokens=2, stream=True)) as r:
                    assert all("usage" not in e for e in _events(await r.text()))
                status, body = await _post(s, url, CMPL, _body(
                    CMPL, stream=True, stream_options={"continuous_usage_stats": 1}))
                assert status == 400 and body["error"]["param"] == "stream_options"
                status, body = await _post(s, url, CMPL, _body(
                    CMPL, stream=True, stream_options={"typo_usage": True}))
                assert status == 400 and body["error"]["param"] == "stream_options"
    asyncio.run(main())


def test_truncate_prompt_tokens_keeps_the_side_asked_for(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                prompt = list(range(100, 110))
                for side in (None, "left", "right"):
                    extra = {"truncation_side": side} if side else {}
                    status, body = await _post(s, url, CMPL, _body(
                        CMPL, prompt=prompt, max_tokens=1, truncate_prompt_tokens=3, **extra))
                    assert status == 200, body
                    assert body["usage"]["prompt_tokens"] == 3
                status, _ = await _post(s, url, CHAT, _body(
                    CHAT, max_tokens=1, truncate_prompt_tokens=2))
                assert status == 200
            got = [ids for _, ids, _, _ in engine.added]
            assert got[:3] == [prompt[-3:], prompt[-3:], prompt[:3]]
            assert len(got[3]) == 2
    asyncio.run(main())


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_a_stream_event_holds_one_entry_per_choice_index(smollm_tokenizer, max_tokens):
    # the echoed prompt and a choice's first tokens (or its finish, at max_tokens 0)
    # used to share one event as two entries of the same index
    async def main():
        async with api_server(smollm_tokenizer) as (url, _):
            async with aiohttp.ClientSession() as s:
                body = _body(CMPL, prompt="Hello there", echo=True, n=2, stream=True,
                             max_tokens=max_tokens, logprobs=1)
                async with s.post(url + CMPL, json=body) as r:
                    assert r.status == 200, await r.text()
                    return [json.loads(line[6:]) for line in (await r.text()).splitlines()
                            if line.startswith("data: {")]
    events = asyncio.run(main())
    texts, finish = {}, {}
    for event in events:
        indices = [c["index"] for c in event["choices"]]
        assert len(indices) == len(set(indices)), event
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    generated = smollm_tokenizer.decode([42] * max_tokens) if max_tokens else ""
    assert texts == {0: "Hello there" + generated, 1: "Hello there" + generated}
    assert finish == {0: "length", 1: "length"}


@pytest.mark.parametrize("stream", [False, True])
def test_echo_shows_the_prompt_truncate_prompt_tokens_left(smollm_tokenizer, stream):
    # the model read " five six": that is what an echo shows, with offsets into it
    async def main():
        async with api_server(smollm_tokenizer) as (url, _):
            async with aiohttp.ClientSession() as s:
                body = _body(CMPL, prompt="one two three four five six", echo=True,
                             logprobs=0, max_tokens=1, truncate_prompt_tokens=2,
                             stream=stream)
                async with s.post(url + CMPL, json=body) as r:
                    assert r.status == 200, await r.text()
                    raw = await r.text()
        events = ([json.loads(line[6:]) for line in raw.splitlines()
                   if line.startswith("data: {")] if stream else [json.loads(raw)])
        text, tokens, offsets = "", [], []
        for event in events:
            for c in event["choices"]:
                text += c["text"]
                if c["logprobs"]:
                    tokens += c["logprobs"]["tokens"]
                    offsets += c["logprobs"]["text_offset"]
        return text, tokens, offsets
    text, tokens, offsets = asyncio.run(main())
    generated = smollm_tokenizer.decode([42])
    assert text == " five six" + generated
    assert tokens == [" five", " six", generated] and offsets == [0, 5, 9]
