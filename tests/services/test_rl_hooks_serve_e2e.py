"""The RL hooks over HTTP on `folio serve` (tiny Llama, an API key): sleep and wake at
both levels with requests in flight (they finish, or are aborted when asked), 503
``sleeping`` while asleep, weight updates equal to a fresh offline LLM on the same
weights, a bad file refused with a 400 naming the tensor, the prefix cache reset with
new weights, collective_rpc on the declared extension. The routes' refusals when the
YAML leaves them off are checked on the in-process engine core at the end."""
import asyncio

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.sampling_params import SamplingParams
from services.protocol import ControlReply, ControlRequest
from services.transport import connect
from tests.services.serve_process import ServeProcess, write_config
from tests.services.service_stack import start_core_stack, tiny_config

MODEL, KEY = "folio-tiny", "sk-rl-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(300, 340))]
CACHED = list(range(1000, 1070))  # 70 tokens: 4 full blocks of 16
DOWN = "layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_serve")
    config = write_config(
        root / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
        api={"api_keys": [KEY]}, memory={"num_blocks": 256},
        services={"startup_timeout_s": 600},  # a cold kernel build on a busy machine
        worker={"enable_sleep_mode": True, "enable_weight_updates": True,
                "extension_cls": "tests.rl_extension:ChecksumExtension"})
    serve = ServeProcess(config, root)
    serve.wait_ready(timeout=600)
    yield serve
    assert serve.stop() == 0, serve.output()[-3000:]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, perturbed_llama_dir, default_model_path):
    """weights folder → the offline LLM's greedy texts for PROMPTS."""
    from folio import LLM
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = {}
    for folder in (tiny_llama_dir, perturbed_llama_dir):
        llm = LLM(model=str(folder), tokenizer=str(default_model_path), dtype="float32",
                  max_model_len=1024, **{"observability.log_level": "warning"})
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
        out[folder] = [o.outputs[0].text for o in outs]
    return out


async def call(http, url, method, route, body=None, headers=AUTH):
    async with http.request(method, url + route, json=body, headers=headers) as r:
        return r.status, await r.json()


async def complete(http, url, prompt, max_tokens=16):
    return await call(http, url, "POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True})


async def texts(http, url):
    out = []
    for prompt in PROMPTS:
        status, body = await complete(http, url, prompt)
        assert status == 200, body
        out.append(body["choices"][0]["text"])
    return out


async def wait_health(http, url, ready):
    """The first /health body ``ready`` accepts (snapshots arrive every 0.1 s)."""
    while True:
        _, health = await call(http, url, "GET", "/health")
        if ready(health):
            return health
        await asyncio.sleep(0.02)


async def wait_running(http, url, n):
    await wait_health(http, url, lambda h: h["engine"]["num_running"] >= n)


def run(coro):
    return asyncio.run(coro)


def test_routes_need_the_key(stack):
    async def main():
        async with aiohttp.ClientSession() as http:
            for method, route in (("POST", "/sleep?level=1"), ("POST", "/wake_up"),
                                  ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache"),
                                  ("POST", "/update_weights"), ("POST", "/collective_rpc")):
                status, body = await call(http, stack.url, method, route, {}, headers={})
                assert status == 401, (route, body)
            status, body = await call(http, stack.url, "GET", "/is_sleeping")
            assert (status, body) == (200, {"is_sleeping": False})
    run(main())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_lets_in_flight_requests_finish_and_wake_restores_outputs(stack, offline,
                                                                        tiny_llama_dir,
                                                                        level):
    async def main():
        async with aiohttp.ClientSession() as http:
            before = await texts(http, stack.url)
            assert before == offline[tiny_llama_dir]
            long = [asyncio.create_task(complete(http, stack.url, p, 200)) for p in PROMPTS]
            await wait_running(http, stack.url, 2)
            status, body = await call(http, stack.url, "POST", f"/sleep?level={level}")
            assert (status, body) == (200, {"is_sleeping": True})
            for task in long:  # nothing lost: every request in flight ran to its end
                status, body = await task
                assert status == 200 and body["choices"][0]["finish_reason"] == "length"
                assert body["usage"]["completion_tokens"] == 200
            status, body = await complete(http, stack.url, PROMPTS[0])
            assert status == 503 and body["error"]["code"] == "sleeping", body
            status, health = await call(http, stack.url, "GET", "/health")
            assert status == 200 and health["status"] == "sleeping"
            assert health["engine"]["sleep_level"] == level
            assert await call(http, stack.url, "GET", "/is_sleeping") == (
                200, {"is_sleeping": True})
            assert await call(http, stack.url, "POST", "/wake_up") == (
                200, {"is_sleeping": False})
            assert await texts(http, stack.url) == before
            health = await wait_health(http, stack.url,
                                       lambda h: h["engine"]["num_requests"] == 0)
            assert health["status"] == "ok" and health["engine"]["num_referenced_blocks"] == 0
    run(main())


def test_sleep_with_abort_ends_requests_in_flight(stack):
    async def main():
        async with aiohttp.ClientSession() as http:
            long = [asyncio.create_task(complete(http, stack.url, p, 900)) for p in PROMPTS]
            await wait_running(http, stack.url, 2)
            status, _ = await call(http, stack.url, "POST", "/sleep?level=1&abort=true")
            assert status == 200
            for task in long:
                status, body = await task
                assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
                assert body["usage"]["completion_tokens"] < 900
            assert (await call(http, stack.url, "POST", "/wake_up"))[0] == 200
            for route in ("/sleep?level=3", "/sleep?level=1&abort=maybe"):
                status, body = await call(http, stack.url, "POST", route)
                assert status == 400 and body["error"]["param"] in ("level", "abort")
    run(main())


def test_weight_updates_over_http(stack, offline, tiny_llama_dir, perturbed_llama_dir,
                                  tmp_path):
    good = load_file(str(perturbed_llama_dir / "model.safetensors"))
    bad = tmp_path / "bad.safetensors"
    save_file({**good, "model.layers.0.mlp.up_proj.weight": torch.zeros(128, 63)}, str(bad))

    async def main():
        async with aiohttp.ClientSession() as http:
            url = stack.url

            async def checksum():
                status, body = await call(http, url, "POST", "/collective_rpc",
                                          {"method": "weight_checksum", "args": [DOWN]})
                assert status == 200, body
                return body["results"][0]

            original = await checksum()
            await complete(http, url, CACHED, 4)
            status, body = await complete(http, url, CACHED, 4)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
            status, body = await call(http, url, "POST", "/update_weights", {"path": str(bad)})
            assert status == 400, body
            assert body["error"]["param"] == "model.layers.0.mlp.up_proj.weight"
            assert await checksum() == original  # nothing changed
            assert await texts(http, url) == offline[tiny_llama_dir]
            status, body = await call(http, url, "POST", "/update_weights",
                                      {"path": str(perturbed_llama_dir)})
            assert status == 200, body
            assert await checksum() != original
            assert await texts(http, url) == offline[perturbed_llama_dir]
            status, body = await complete(http, url, CACHED, 4)  # cached before the update
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert (await call(http, url, "POST", "/reset_prefix_cache"))[0] == 200
            status, body = await complete(http, url, CACHED, 4)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            status, body = await call(http, url, "POST", "/update_weights",
                                      {"path": str(tiny_llama_dir / "model.safetensors")})
            assert status == 200, body
            assert await checksum() == original
            assert await texts(http, url) == offline[tiny_llama_dir]
            for payload, param in (({}, "path"), ({"path": 5}, "path"),
                                   ({"path": str(tmp_path / "missing")}, "path")):
                status, body = await call(http, url, "POST", "/update_weights", payload)
                assert status == 400 and body["error"]["param"] == param, body
            status, body = await call(http, url, "POST", "/collective_rpc",
                                      {"method": "_private"})
            assert status == 400, body
    run(main())


def test_control_verbs_off_by_default(tiny_llama_dir, default_model_path, tmp_path):
    """Without the YAML switches the engine core refuses each verb, naming the key."""
    async def main():
        worker, core, engine_ep, runners, task = await start_core_stack(
            tiny_config(tiny_llama_dir, default_model_path), tmp_path)
        link, session = await connect(engine_ep, "engine-core")
        try:
            messages = link.messages()
            replies = {}
            for i, op in enumerate(("sleep", "wake_up", "update_weights", "collective_rpc",
                                    "is_sleeping", "reset_prefix_cache")):
                await link.send(ControlRequest(f"c{i}", op, level=1, path="/x"))
                async for message in messages:
                    if isinstance(message, ControlReply):
                        replies[op] = message
                        break
            for op, key in (("sleep", "enable_sleep_mode"), ("wake_up", "enable_sleep_mode"),
                            ("update_weights", "enable_weight_updates"),
                            ("collective_rpc", "extension_cls")):
                assert not replies[op].ok and replies[op].code == "not_enabled"
                assert f"worker.{key}" in replies[op].message
            assert replies["is_sleeping"].ok and not replies["is_sleeping"].is_sleeping
            assert replies["reset_prefix_cache"].ok
        finally:
            await link.close()
            await session.close()
            task.cancel()
            for runner in runners:
                await runner.cleanup()
    run(main())
