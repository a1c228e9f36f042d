"""`folio serve` end to end: real worker, engine-core and API processes on temporary
unix sockets, spoken to over HTTP with the official ``openai`` client.

One stack (tiny model, two API processes, four sequences at a time so that requests
queue) serves the module; tests that stop or break a stack start their own.
"""
import asyncio
import json

import aiohttp
import openai
import pytest

from engine_core.sampling_params import SamplingParams
from observability.process_stats import is_running
from tests.services.serve_process import ServeProcess, write_config

MODEL = "folio-tiny"


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    config = write_config(folder / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
                          scheduler={"max_num_seqs": 4},
                          services={"num_api_servers": 2})
    serve = ServeProcess(config, folder)
    serve.wait_ready()
    yield serve
    assert serve.stop() == 0, serve.output()[-3000:]
    assert not any(is_running(p) for p in serve.child_pids)


def run(coro):
    return asyncio.run(coro)


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


async def engine_gauges(url, key: str | None = None) -> dict:
    """The engine's gauges from /health (with keys set, they need one)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health", headers=headers) as r:
            assert r.status == 200
            return (await r.json())["engine"]


async def wait_engine_clean(url, within: float = 2.0, key: str | None = None) -> dict:
    """Poll /health until no request is left and every KV block is free again."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        g = await engine_gauges(url, key)
        if (g["num_running"] == 0 and g["num_waiting"] == 0
                and g["num_free_blocks"] == g["num_blocks"]):
            return g
        assert asyncio.get_running_loop().time() < deadline, g
        await asyncio.sleep(0.05)


async def sse_payloads(response) -> list:
    """Every ``data:`` payload of an SSE response, parsed ([DONE] kept as a string)."""
    payloads = []
    async for line in response.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def test_models_health_and_both_api_processes(stack):
    async def main():
        c = client(stack.url)
        assert [m.id for m in (await c.models.list()).data] == [MODEL]
        outs = await asyncio.gather(*(c.completions.create(
            model=MODEL, prompt=f"Request {i}", max_tokens=4) for i in range(8)))
        assert all(o.usage.completion_tokens >= 1 for o in outs)
        gauges = await engine_gauges(stack.url)
        assert gauges["num_clients"] == 2  # both API processes hold an engine link
        async with aiohttp.ClientSession() as s:
            async with s.get(stack.url + "/version") as r:
                assert r.status == 200 and "version" in await r.json()
    run(main())


def test_completions_and_chat_streaming_and_not(stack):
    async def main():
        c = client(stack.url)
        full = await c.completions.create(model=MODEL, prompt="Hello there", max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 10 and full.usage.prompt_tokens == 2
        stream = await c.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        pieces, usage = [], None
        async for chunk in stream:
            pieces += [ch.text for ch in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(pieces) == full.choices[0].text
        assert (usage.prompt_tokens, usage.completion_tokens) == (2, 10)
        messages = [{"role": "user", "content": "Hi"}]
        plain = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                temperature=0)
        streamed = await c.chat.completions.create(model=MODEL, messages=messages,
                                                   max_tokens=8, temperature=0, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in streamed
                        if ch.choices])
        assert text == plain.choices[0].message.content
        assert plain.usage.completion_tokens == 8 or plain.choices[0].finish_reason == "stop"
    run(main())


def test_n_logprobs_and_seeded_sampling_reproducible(stack):
    async def main():
        c = client(stack.url)
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                      n=2, seed=3, temperature=1.0, logprobs=True, top_logprobs=2,
                      extra_body={"ignore_eos": True})
        first, again = [await c.chat.completions.create(**kwargs) for _ in range(2)]
        assert len(first.choices) == 2 and first.usage.completion_tokens == 12
        for ch in first.choices:
            assert len(ch.logprobs.content) == 6
            assert all(len(e.top_logprobs) == 2 for e in ch.logprobs.content)
        texts = [ch.message.content for ch in first.choices]
        assert texts == [ch.message.content for ch in again.choices]
        assert texts[0] != texts[1]  # two samples, not one copied
    run(main())


def test_stop_strings_trimmed_streaming_and_not(stack):
    async def main():
        c = client(stack.url)
        base = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0,
                    extra_body={"ignore_eos": True})
        text = (await c.completions.create(**base)).choices[0].text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        want = text[:text.index(stop)]
        cut = await c.completions.create(**base, stop=[stop])
        assert cut.choices[0].text == want and cut.choices[0].finish_reason == "stop"
        stream = await c.completions.create(**base, stop=[stop], stream=True)
        assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == want
        await wait_engine_clean(stack.url)  # the stop string aborted the request
    run(main())


def test_streamed_text_equals_full_text_with_multibyte_characters(stack):
    async def main():
        c = client(stack.url)
        saw_multibyte = False
        for seed in range(6):
            kwargs = dict(model=MODEL, prompt="Écris en français: ", max_tokens=24,
                          temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
            full = (await c.completions.create(**kwargs)).choices[0].text
            stream = await c.completions.create(**kwargs, stream=True)
            joined = "".join([ch.choices[0].text async for ch in stream if ch.choices])
            assert joined == full
            saw_multibyte |= any(ord(ch) > 127 for ch in full)
        assert saw_multibyte  # the random model samples byte tokens: the case is exercised
    run(main())


def test_greedy_over_http_equals_offline_llm(stack, make_tiny_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    llm = make_tiny_llm(max_model_len=1024)
    offline = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        use_tqdm=False)]

    async def main():
        c = client(stack.url)
        outs = await asyncio.gather(*(c.completions.create(
            model=MODEL, prompt=p, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True}) for p in prompts))
        assert [o.choices[0].text for o in outs] == offline
    run(main())


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"model": MODEL, "prompt": [49152]}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(stack, body, status, param):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/completions", json=body) as r:
                assert r.status == status
                err = (await r.json())["error"]
                assert err["param"] == param and err["message"] and "type" in err
            async with s.post(stack.url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400
        await engine_gauges(stack.url)  # still healthy
    run(main())


def test_disconnects_mid_stream_and_while_queued_free_everything(stack):
    long = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 900,
            "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            # four streams fill max_num_seqs=4; a fifth request waits in the queue
            streams = [await s.post(stack.url + "/v1/completions",
                                    json={**long, "stream": True}) for _ in range(4)]
            for r in streams:
                await r.content.readline()
            queued = asyncio.ensure_future(s.post(stack.url + "/v1/completions", json=long))
            for _ in range(100):
                if (await engine_gauges(stack.url))["num_waiting"] == 1:
                    break
                await asyncio.sleep(0.02)
            assert (await engine_gauges(stack.url))["num_waiting"] == 1
            queued.cancel()  # the queued client hangs up
            t0 = asyncio.get_running_loop().time()
            while (await engine_gauges(stack.url))["num_waiting"]:
                assert asyncio.get_running_loop().time() - t0 < 2.0
                await asyncio.sleep(0.05)
            assert (await engine_gauges(stack.url))["num_running"] == 4
            for r in streams:  # the streaming clients hang up mid-stream
                r.close()
        await wait_engine_clean(stack.url, within=2.0)
    run(main())


def test_bench_serve_reports_a_run_and_a_sweep(stack, smollm_tokenizer, tmp_path):
    from folio.bench.serve import LoadSpec, bench_serve
    from folio.bench.workload import make_workload
    from folio.cli import main as folio_main
    reqs = make_workload(smollm_tokenizer, "fixed", 8, input_len=16, output_len=8)
    report = bench_serve(stack.url, MODEL, reqs, LoadSpec(max_concurrency=4),
                         slo_ms={"ttft": 60_000})
    assert (report["completed"], report["failed"]) == (8, 0)
    assert report["total_output_tokens"] == 64
    assert report["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert 0 < report["ttft_ms"]["p50"] <= report["e2e_ms"]["p50"]
    assert report["itl_ms"]["mean"] > 0 and report["goodput"]["requests_meeting_slo"] == 8
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    status = folio_main(["bench", "serve", "--base-url", stack.url, "--model", MODEL,
                         "--dataset", "uniform", "--num-prompts", "6", "--input-len", "16",
                         "--output-len", "6", "--sweep-rates", "20", "inf",
                         "--result-json", str(out), "--plot", str(png)])
    assert status == 0
    runs = json.loads(out.read_text())
    assert [r["load"]["request_rate"] for r in runs] == [20, float("inf")]
    assert all(r["completed"] == 6 for r in runs)
    assert png.read_bytes()[:4] == b"\x89PNG"
