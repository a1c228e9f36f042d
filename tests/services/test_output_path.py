"""Offline and HTTP produce the same text through the same code (issue 13).

One scripted engine answer drives both paths: the offline ``LLM.generate`` loop and
the API process (JSON and SSE, completions and chat). The script holds n = 3 samples
with logprobs whose tokens split multi-byte characters, two stop strings that straddle
token boundaries (the engine keeps generating after one matched, until the abort lands,
and then reports the abort) and a sample that ends by length.
"""
from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest

from engine_core.outputs import EngineCoreOutput, FinishReason, TokenLogprobs
from engine_core.sampling_params import SamplingParams
from folio.llm import LLM
from tests.services.api_harness import FakeEngine, api_server
from text.output_processor import OutputProcessor

TEXTS = ["Le café coûte 3€ 🙂 au total. Fin du texte ici, merci.",
         "日本語のテキスト: 東京タワー END marker",
         "naïve résumé 👍🏽 STOP now and then more"]
STOP = ["xte ic", "STOP"]  # each straddles a token boundary
EXPECTED = ["Le café coûte 3€ 🙂 au total. Fin du te", TEXTS[1], "naïve résumé 👍🏽 "]
FINISH = ["stop", "length", "stop"]
PARAMS = dict(n=3, max_tokens=40, logprobs=2, stop=STOP, temperature=0)


def _script(tokenizer, req_id: str) -> list[list[EngineCoreOutput]]:
    """The engine's steps: each sample's tokens in chunks of 1-3, interleaved; the stop
    strings' samples run on, then end as aborted (what the engine reports)."""
    chunks = []
    for index, text in enumerate(TEXTS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        sizes = itertools.cycle([1, 3, 2])
        pos, sample = 0, []
        while pos < len(ids):
            new = ids[pos:pos + next(sizes)]
            pos += len(new)
            sample.append(EngineCoreOutput(
                f"{index}_{req_id}", new,
                [TokenLogprobs(t, -0.25 * (pos % 7), 1, [t, 5], [-0.25 * (pos % 7), -3.0])
                 for t in new],
                finish_reason=FinishReason.LENGTH if index == 1 and pos == len(ids) else None,
                parent_req_id=req_id, index=index))
        if index != 1:
            sample.append(EngineCoreOutput(f"{index}_{req_id}", [], None, FinishReason.ABORT,
                                           parent_req_id=req_id, index=index))
        chunks.append(sample)
    return [[c for c in step if c is not None]
            for step in itertools.zip_longest(*chunks)]


class ScriptedEngine:
    """The EngineCore calls the offline loop makes, answered from the script."""

    def __init__(self, tokenizer):
        self.tokenizer, self.steps, self.aborted = tokenizer, [], []

    def validate_request(self, ids, params, lora_id=0):
        return params

    def add_request(self, req_id, ids, params, lora_id=0):
        self.steps = _script(self.tokenizer, req_id)
        return [f"{i}_{req_id}" for i in range(params.n)]

    def step(self):
        return self.steps.pop(0) if self.steps else []

    def has_unfinished_requests(self):
        return bool(self.steps)

    def abort_request(self, req_ids):
        self.aborted.extend(req_ids)


def _offline(tokenizer, prompt_ids):
    llm = LLM.__new__(LLM)  # the real generate/_run loop around a scripted engine
    llm.tokenizer, llm.engine = tokenizer, ScriptedEngine(tokenizer)
    llm.processor, llm._ids = OutputProcessor(tokenizer), itertools.count()
    [out] = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(**PARAMS),
                         use_tqdm=False)
    return out, llm.engine.aborted


async def _http(tokenizer, chat: bool, stream: bool):
    engine = FakeEngine(script=lambda req_id, params: [
        o for step in _script(tokenizer, req_id) for o in step])
    async with api_server(tokenizer, engine=engine) as (url, _):
        body = dict(PARAMS, model="folio-tiny", stream=stream)
        if chat:
            body.update(messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                        top_logprobs=body.pop("logprobs"))
        else:
            body["prompt"] = "Hello"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                raw = await resp.text()
    texts, finish, logprobs, raw_bytes = ["", "", ""], [None] * 3, [[], [], []], [b""] * 3
    events = ([json.loads(line[6:]) for line in raw.splitlines()
               if line.startswith("data: {")] if stream else [json.loads(raw)])
    for event in events:
        for choice in event["choices"]:
            i = choice["index"]
            part = choice.get("delta", choice.get("message", {})) if chat else choice
            texts[i] += part.get("content") or "" if chat else part["text"]
            finish[i] = choice["finish_reason"] or finish[i]
            lp = choice.get("logprobs")
            if lp:
                logprobs[i] += ([c["logprob"] for c in lp["content"]] if chat
                                else lp["token_logprobs"])
                if chat:
                    raw_bytes[i] += b"".join(bytes(c["bytes"]) for c in lp["content"])
    return texts, finish, logprobs, raw_bytes, engine.aborted


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_offline_and_http_give_the_same_outputs(smollm_tokenizer, chat, stream):
    offline, offline_aborted = _offline(smollm_tokenizer,
                                        smollm_tokenizer.encode("Hello"))
    texts, finish, logprobs, raw_bytes, http_aborted = asyncio.run(
        _http(smollm_tokenizer, chat, stream))
    assert [c.text for c in offline.outputs] == EXPECTED
    assert texts == EXPECTED
    assert [c.finish_reason for c in offline.outputs] == finish == FINISH
    assert [c.stop_reason for c in offline.outputs] == ["xte ic", None, "STOP"]
    assert logprobs == [[lp.logprob for lp in c.token_logprobs] for c in offline.outputs]
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in offline.outputs)
    assert logprobs == [[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
                        for c in offline.outputs]
    if chat:  # each token's own bytes, joined, spell the characters tokens split
        for c, joined in zip(offline.outputs, raw_bytes):
            assert joined == smollm_tokenizer.decode(c.token_ids).encode()
        assert raw_bytes[1] == TEXTS[1].encode()
    # the samples that a stop string ended, and only those, were aborted in the engine
    for aborted in (offline_aborted, http_aborted):
        assert sorted(a.split("_", 1)[0] for a in aborted) == ["0", "2"]
