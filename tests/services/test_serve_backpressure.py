"""Backpressure through `folio serve`: past scheduler.max_num_queued_requests (or
max_num_queued_tokens) new requests get 503 with Retry-After, the limit holds across
two API processes, a full queue refuses before tokenizing, and cancellations bring the
count back to 0."""
import asyncio
import json
import shutil
import time

import aiohttp
import pytest

from tests.services.serve_process import running, write_config
from tests.services.test_serve_e2e import MODEL
from tests.services.test_serve_reliability import health, session

PROMPT = [5, 6, 7, 8, 9]  # token ids: the queued-token counts below are exact
# 8,000 decode steps keep the two running requests busy for the whole test
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True}


@pytest.fixture
def long_context_model(tiny_llama_dir, tmp_path):
    """The tiny Llama with room for 8k positions (its weights do not depend on it)."""
    folder = tmp_path / "tiny-8k"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (folder / "config.json").write_text(json.dumps(config))
    return folder


async def wait_for(s, url, cond, within: float = 20.0) -> dict:
    """Poll the engine's gauges until ``cond(gauges)``."""
    deadline = asyncio.get_running_loop().time() + within
    while not cond(g := (await health(s, url))["engine"]):
        assert asyncio.get_running_loop().time() < deadline, g
        await asyncio.sleep(0.05)
    return g


async def assert_queue_full(r: aiohttp.ClientResponse, why: str = "") -> None:
    assert r.status == 503, await r.text()
    assert r.headers["Retry-After"] == "1"
    error = (await r.json())["error"]
    assert error["code"] == "queue_full" and why in error["message"]


async def _fill_and_drain(url: str) -> None:
    async with session() as s:
        running = [await s.post(url + "/v1/completions", json={**LONG, "stream": True})
                   for _ in range(2)]  # max_num_seqs=2: every slot taken
        for r in running:
            await r.content.readline()
        queued = [asyncio.ensure_future(s.post(url + "/v1/completions", json=LONG))
                  for _ in range(3)]
        g = await wait_for(s, url, lambda g: g["num_waiting"] == 3)
        assert g["num_waiting_tokens"] == 15 and g["is_queue_full"] == 0

        # 15 queued tokens + 190 pass max_num_queued_tokens=200: the engine core refuses
        big = {**LONG, "prompt": list(range(1000, 1190)), "max_tokens": 8}
        async with s.post(url + "/v1/completions", json=big) as r:
            await assert_queue_full(r, "max_num_queued_tokens=200")

        # six race for the last place (max_num_queued_requests=4) through two API
        # processes: the engine core admits exactly one. A loser is refused by the
        # engine core (naming the key) or, once its API process has heard the queue is
        # full, by that process before it is forwarded: both are the same 503.
        racers = [asyncio.ensure_future(s.post(url + "/v1/completions", json=LONG))
                  for _ in range(6)]
        deadline = time.monotonic() + 20
        while sum(f.done() for f in racers) < 5:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        for f in [f for f in racers if f.done()]:
            await assert_queue_full(f.result(), "at capacity")
        queued += [f for f in racers if not f.done()]
        g = await wait_for(s, url, lambda g: g["is_queue_full"] == 1)
        assert (g["num_running"], g["num_waiting"]) == (2, 4)

        # Every API process now knows: a 1 MB prompt is refused before it is read or
        # tokenized (tokenized, it would be a 400: longer than max_model_len).
        await asyncio.sleep(0.2)
        huge = {**LONG, "prompt": "word " * 200_000}
        for _ in range(6):
            t0 = time.monotonic()
            async with s.post(url + "/v1/completions", json=huge) as r:
                await assert_queue_full(r)
            assert time.monotonic() - t0 < 2.0

        for f in queued:  # the queued clients hang up
            f.cancel()
        await wait_for(s, url, lambda g: g["num_waiting"] == 0 and g["is_queue_full"] == 0
                       and g["num_waiting_tokens"] == 0)
        for r in running:
            r.close()
        await wait_for(s, url, lambda g: g["num_requests"] == 0
                       and g["num_referenced_blocks"] == 0)
        for _ in range(6):  # both API processes admit again
            async with s.post(url + "/v1/completions",
                              json={**LONG, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
        # a request is admitted whole: ten prompts pass max_num_seqs plus the queue
        # limit (2 + 4), and an idle engine still takes all of them
        batch = {**LONG, "prompt": [[5, 6, 7 + k] for k in range(10)], "max_tokens": 2}
        async with s.post(url + "/v1/completions", json=batch) as r:
            assert r.status == 200, await r.text()
            assert len((await r.json())["choices"]) == 10


def test_full_queue_answers_503_with_retry_after_then_recovers(long_context_model,
                                                                default_model_path,
                                                                tmp_path):
    config = write_config(
        tmp_path / "folio.yaml", str(long_context_model), str(default_model_path),
        model={"max_model_len": 8192}, memory={"num_blocks": 1100},
        scheduler={"max_num_seqs": 2, "max_num_queued_requests": 4,
                   "max_num_queued_tokens": 200},
        services={"num_api_servers": 2})
    with running(config, tmp_path) as serve:
        asyncio.run(_fill_and_drain(serve.url))
