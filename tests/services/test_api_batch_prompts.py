"""Issue 18: a list of prompts in one /v1/completions request gives n choices per
prompt, choice ``k * n + i`` being sample i of prompt k (OpenAI's and vLLM's order),
whether the answer is JSON or a stream, with texts or token-id lists as prompts.

The engine stand-in answers every sample with its own prompt's last token repeated, so
each choice shows which prompt it came from, and it delivers the samples of later
prompts first so the order cannot come from arrival.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp

from engine_core.outputs import EngineCoreOutput, FinishReason
from tests.services.api_harness import FakeEngine, api_server

CMPL = "/v1/completions"


class PromptEchoEngine(FakeEngine):
    """Each sample's tokens: ``max_tokens`` copies of its prompt's last id; the
    outputs reach the API with the newest request's first (reversed order)."""

    async def add(self, req_id, ids, params, traceparent=None, cache_salt=None,
                  tenant=None, tenant_weight=1.0, lora_name=None, batch_id=None):
        self.added.append((req_id, list(ids), params, cache_salt))
        self.batch_ids.append((req_id, batch_id))
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            await asyncio.sleep(0.05 / len(self.added))  # later prompts answer first
            for i in range(params.n):
                queue.put_nowait(EngineCoreOutput(
                    req_id if params.n == 1 else f"{i}_{req_id}",
                    [ids[-1]] * params.max_tokens, finish_reason=FinishReason.LENGTH,
                    parent_req_id=None if params.n == 1 else req_id, index=i))
        asyncio.ensure_future(deliver())
        return queue


def _texts(tokenizer, ids):
    return [tokenizer.decode([t] * 2) for t in ids]


def test_a_batch_of_token_id_prompts_with_n_2_orders_choices_by_prompt(smollm_tokenizer):
    prompts = [[5, 300], [7, 301], [9, 302]]

    async def main():
        engine = PromptEchoEngine()
        async with api_server(smollm_tokenizer, engine=engine) as (url, _):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + CMPL, json={
                        "prompt": prompts, "n": 2, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    out = await r.json()
        want = _texts(smollm_tokenizer, [300, 300, 301, 301, 302, 302])
        assert [c["index"] for c in out["choices"]] == list(range(6))
        assert [c["text"] for c in out["choices"]] == want
        assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 12,
                                "total_tokens": 18,
                                "prompt_tokens_details": {"cached_tokens": 0}}
        assert sorted(ids for _, ids, _, _ in engine.added) == prompts
        assert len({req_id for req_id, *_ in engine.added}) == 3
        # every prompt names the request: the engine admits the request whole
        sub_ids, batch_ids = zip(*engine.batch_ids)
        assert len(set(batch_ids)) == 1 and all(i.startswith(batch_ids[0] + "-")
                                                for i in sub_ids)
    asyncio.run(main())


def test_a_batch_of_texts_streams_every_choice_under_its_index(smollm_tokenizer):
    texts = ["Hello there", "The capital of France is", "1 2 3"]
    last = [smollm_tokenizer.encode(t)[-1] for t in texts]

    async def main():
        async with api_server(smollm_tokenizer, engine=PromptEchoEngine()) as (url, _):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + CMPL, json={
                        "prompt": texts, "n": 2, "max_tokens": 2, "stream": True,
                        "stream_options": {"include_usage": True}}) as r:
                    assert r.status == 200
                    raw = await r.text()
        events = [json.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: {")]
        text, finish = {}, {}
        for e in events[:-1]:
            (choice,) = e["choices"]
            text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
        assert text == {i: smollm_tokenizer.decode([last[i // 2]] * 2) for i in range(6)}
        assert finish == {i: "length" for i in range(6)}
        assert events[-1]["usage"]["completion_tokens"] == 12
        assert raw.rstrip().endswith("data: [DONE]")
    asyncio.run(main())


def test_a_batch_larger_than_the_limit_is_refused(smollm_tokenizer):
    from config.schema import APIConfig

    async def main():
        async with api_server(smollm_tokenizer, APIConfig(max_batch_prompts=2)) as (
                url, engine):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + CMPL, json={"prompt": ["a", "b", "c"]}) as r:
                    body = await r.json()
                    assert r.status == 400 and body["error"]["param"] == "prompt"
                    assert "at most 2 prompts" in body["error"]["message"]
            assert engine.added == []
    asyncio.run(main())
