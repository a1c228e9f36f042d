"""The OpenAI-compatible API over the real engine-core and worker services.

Everything runs in one event loop for speed, but on real sockets: worker and engine
core on unix sockets, the API on a loopback TCP port, spoken to by the official
``openai`` client.
"""
import asyncio
import socket

import aiohttp
import openai
import pytest

from services.api.app import APIServer
from services.api.engine_client import EngineClient
from services.api.tokenizer import Tokenizer
from services.transport import Endpoint, start_site
from tests.services.service_stack import start_core_stack, tiny_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_stack(config, tmp_path, default_model_path):
    worker, core, engine_ep, runners, task = await start_core_stack(config, tmp_path)
    client = EngineClient(engine_ep, "api-0")
    await client.start()
    api = APIServer(client, Tokenizer.from_model_path(default_model_path), "folio-tiny",
                    worker.runner.max_model_len)
    port = free_port()
    runners.append(await start_site(api.app(), Endpoint(host="127.0.0.1", port=port)))
    return core, f"http://127.0.0.1:{port}", runners, [task], client


@pytest.fixture
def stack(tiny_llama_dir, default_model_path, tmp_path):
    config = tiny_config(tiny_llama_dir, default_model_path)

    def run(scenario):
        async def main():
            core, url, runners, tasks, client = await start_stack(config, tmp_path,
                                                                  default_model_path)
            try:
                await scenario(core, url)
            finally:
                for t in tasks:
                    t.cancel()
                await client.close()
                await core.close()
                for r in reversed(runners):
                    await r.cleanup()
        asyncio.run(main())
    return run


def test_completions_chat_and_streaming(stack):
    async def scenario(core, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")
        models = await client.models.list()
        assert models.data[0].id == "folio-tiny"
        full = await client.completions.create(model="folio-tiny", prompt="Hello there",
                                               max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
        stream = await client.completions.create(
            model="folio-tiny", prompt="Hello there", max_tokens=10, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        pieces, last_usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
            if chunk.usage:
                last_usage = chunk.usage
        assert "".join(pieces) == full.choices[0].text
        assert last_usage.completion_tokens == 10
        chat = await client.chat.completions.create(
            model="folio-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            n=2, seed=3, temperature=1.0, logprobs=True, top_logprobs=2)
        assert len(chat.choices) == 2
        for c in chat.choices:
            assert 1 <= len(c.logprobs.content) <= 6
            assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
        streamed = await client.chat.completions.create(
            model="folio-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in streamed])
        plain = await client.chat.completions.create(
            model="folio-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0)
        assert text == plain.choices[0].message.content
        assert core.engine.scheduler.kv_cache_manager.usage == 0.0
    stack(scenario)


@pytest.mark.parametrize("body,status,param", [
    ({"model": "folio-tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "folio-tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "folio-tiny", "prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"model": "folio-tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "folio-tiny", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "folio-tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"model": "folio-tiny", "prompt": [49152]}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(stack, body, status, param):
    async def scenario(core, url):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == status
                err = (await r.json())["error"]
                assert err["param"] == param and err["message"]
            async with s.post(url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400
            async with s.get(url + "/health") as r:
                assert r.status == 200
    stack(scenario)


def test_client_disconnect_aborts_and_frees_blocks(stack):
    async def scenario(core, url):
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/completions", json={
                "model": "folio-tiny", "prompt": "Tell me everything", "max_tokens": 200,
                "stream": True, "ignore_eos": True})
            await r.content.readline()
            r.close()  # drop the connection mid-stream
        for _ in range(200):
            await asyncio.sleep(0.05)
            if not core.engine.has_unfinished_requests():
                break
        assert not core.engine.has_unfinished_requests()
        assert core.engine.scheduler.kv_cache_manager.usage == 0.0
    stack(scenario)
