"""Issue 18: vLLM's routes (/ping, /load, /tokenizer_info, GET /v1/models/{id},
/invocations) on the real API process in front of the harness's engine stand-in."""
from __future__ import annotations

import asyncio

import aiohttp

from tests.services.api_harness import api_server


def test_vllm_routes_answer_like_vllm(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                for method in ("GET", "POST"):
                    async with s.request(method, url + "/ping") as r:
                        assert r.status == 200 and (await r.json())["status"] == "ok"
                async with s.get(url + "/load") as r:
                    assert await r.json() == {"server_load": 0}
                async with s.get(url + "/tokenizer_info") as r:
                    info = await r.json()
                assert info["vocab_size"] == smollm_tokenizer.vocab_size
                assert info["eos_token_ids"] == list(smollm_tokenizer.eos_token_ids)
                assert "<|im_start|>" in info["chat_template"]
                async with s.get(url + "/v1/models/folio-tiny") as r:
                    card = await r.json()
                    assert r.status == 200 and card["id"] == "folio-tiny"
                async with s.get(url + "/v1/models/gpt-4") as r:
                    body = await r.json()
                    assert r.status == 404 and body["error"]["param"] == "model"
                async with s.post(url + "/invocations", json={
                        "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 2}) as r:
                    assert (await r.json())["object"] == "chat.completion"
                async with s.post(url + "/invocations", json={
                        "prompt": "Hi", "max_tokens": 2}) as r:
                    assert (await r.json())["object"] == "text_completion"
                async with s.post(url + "/invocations", json={"input": "Hi"}) as r:
                    assert r.status == 400
            assert len(engine.added) == 2
    asyncio.run(main())
