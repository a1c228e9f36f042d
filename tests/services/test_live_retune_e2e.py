"""Live retune on a running `folio serve` stack (issue 20): the YAML edited under it
(file watch), SIGHUP to the launcher, and POST /admin/reload_config on either of two API
processes all take the same path; live keys change every process, a restart-only key
or a bad file changes none. One stack for the module; each test puts the base config
back (and checks it took) before it ends."""
import asyncio
import json
import shutil
import signal
import tempfile
import time

import aiohttp
import pytest

from observability.otlp_receiver import OTLPReceiver
from tests.services.serve_process import ServeProcess, write_config
from tests.services.test_serve_e2e import MODEL, sse_payloads

pytestmark = pytest.mark.slow
KEY = "retune-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = dict(model={"max_model_len": 256}, memory={"num_blocks": 256},
            scheduler={"max_num_seqs": 8, "max_num_queued_requests": 64},
            api={"api_keys": [KEY]},
            observability={"log_level": "info", "trace_sample_ratio": 1.0})


@pytest.fixture(scope="module")
def receiver():
    r = OTLPReceiver()
    yield r
    r.close()


class Stack:
    """The running stack, its YAML file and the paths to each API process."""

    def __init__(self, serve: ServeProcess, path, model_args, socket_dir: str, otlp: str):
        self.serve, self.path, self.model_args = serve, path, model_args
        self.socket_dir, self.otlp = socket_dir, otlp

    def write(self, **edits) -> None:
        """The file as BASE with ``edits`` merged in, written in one go."""
        sections = {name: dict(values) for name, values in BASE.items()}
        sections["observability"]["otlp_endpoint"] = self.otlp
        sections["services"] = {"num_api_servers": 2, "socket_dir": self.socket_dir,
                                "startup_timeout_s": 600}  # a busy 2-core machine
        for name, values in edits.items():
            sections.setdefault(name, {}).update(values)
        write_config(self.path, *self.model_args, **sections)

    def unix(self, index: int) -> aiohttp.UnixConnector:
        return aiohttp.UnixConnector(path=f"{self.socket_dir}/api-{index}.sock")


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory, receiver):
    folder = tmp_path_factory.mktemp("retune")
    socket_dir = tempfile.mkdtemp(prefix="folio-")
    s = Stack(None, folder / "folio.yaml", (str(tiny_llama_dir), str(default_model_path)),
              socket_dir, receiver.url)
    s.write()
    s.serve = ServeProcess(s.path, folder, env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        s.serve.wait_ready(timeout=600)  # a busy shared machine starts slowly
    except BaseException:
        s.serve.stop()
        raise
    yield s
    assert s.serve.stop() == 0, s.serve.output()[-3000:]
    shutil.rmtree(socket_dir, ignore_errors=True)


async def api(stack: Stack, method: str, path: str, index: int = 0, **kw):
    """(status, JSON body) from API process ``index`` over its own unix socket."""
    async with aiohttp.ClientSession(connector=stack.unix(index)) as s:
        async with s.request(method, "http://api" + path, **kw) as r:
            return r.status, await r.json(content_type=None)


async def running_config(stack: Stack, index: int = 0) -> dict:
    status, body = await api(stack, "GET", "/admin/config", index, headers=AUTH)
    assert status == 200, body
    return body


async def reload(stack: Stack, index: int = 0) -> tuple[int, dict]:
    return await api(stack, "POST", "/admin/reload_config", index, headers=AUTH)


async def health(stack: Stack) -> dict:
    status, body = await api(stack, "GET", "/health", headers=AUTH)
    assert status == 200, body
    return body["engine"]


async def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def restore(stack: Stack) -> None:
    stack.write()
    status, body = await reload(stack)
    assert status == 200, body
    for index in (0, 1):
        config = await running_config(stack, index)
        assert config["scheduler"]["max_num_seqs"] == 8
        assert config["observability"]["trace_sample_ratio"] == 1.0


async def stream(session: aiohttp.ClientSession, url: str, max_tokens: int,
                 prompt: str = "Count with me") -> int:
    """One streamed completion to its end; the number of tokens it carried."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        payloads = await sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    return payloads[-2]["usage"]["completion_tokens"]


def test_admin_config_needs_the_key_and_redacts_secrets(stack):
    async def main():
        status, body = await api(stack, "GET", "/admin/config")
        assert status == 401 and "error" in body
        status, _ = await api(stack, "POST", "/admin/reload_config")
        assert status == 401
        for index in (0, 1):
            config = await running_config(stack, index)
            assert config["api"]["api_keys"] == "<redacted>"
            assert KEY not in json.dumps(config)
            assert config["scheduler"]["max_num_seqs"] == 8
    asyncio.run(main())


def test_editing_max_num_seqs_caps_the_next_steps_and_drops_nothing(stack):
    async def main():
        seen_running = []
        async with aiohttp.ClientSession() as session:
            first = [asyncio.create_task(stream(session, stack.serve.url, 100))
                     for _ in range(6)]
            await wait_until(lambda: _running_at_least(stack, 6), "6 running")
            stack.write(scheduler={"max_num_seqs": 2})  # the file watch picks it up

            async def applied():
                return (await health(stack))["max_num_seqs"] == 2
            await wait_until(applied, "max_num_seqs 2 in /health")
            more = [asyncio.create_task(stream(session, stack.serve.url, 40))
                    for _ in range(4)]
            while not all(t.done() for t in first + more):
                engine = await health(stack)
                seen_running.append((engine["num_running"], engine["num_waiting"]))
                await asyncio.sleep(0.05)
            counts = [await t for t in first + more]
            metrics = await _text(stack, "/metrics")
        assert counts == [100] * 6 + [40] * 4  # nothing dropped, nothing cut short
        # the six admitted before the edit run on; once under 2, never above 2 again
        under = next(i for i, (n, _) in enumerate(seen_running) if n <= 2)
        assert all(n <= 2 for n, _ in seen_running[under:])
        assert any(w > 0 for _, w in seen_running)  # the new limit made requests wait
        assert 'config_reloads_total{result="applied"}' in metrics
        for index in (0, 1):
            assert (await running_config(stack, index))["scheduler"]["max_num_seqs"] == 2
        await restore(stack)

        async def back():  # /health answers from a snapshot pushed every 100 ms
            return (await health(stack))["max_num_seqs"] == 8
        await wait_until(back, "max_num_seqs 8 in /health")
    asyncio.run(main())
    assert "config reloaded" in stack.serve.output()


async def _running_at_least(stack, n):
    return (await health(stack))["num_running"] >= n


async def _text(stack, path):
    async with aiohttp.ClientSession(connector=stack.unix(0)) as s:
        async with s.get("http://api" + path, headers=AUTH) as r:
            assert r.status == 200
            return await r.text()


def test_lowering_max_num_queued_requests_turns_on_503(stack):
    async def main():
        stack.write(scheduler={"max_num_seqs": 1, "max_num_queued_requests": 0})
        status, body = await reload(stack, index=1)  # via the other API process
        assert status == 200, body
        assert set(body["changed"]) >= {"scheduler.max_num_seqs",
                                        "scheduler.max_num_queued_requests"}
        async with aiohttp.ClientSession() as session:
            long = asyncio.create_task(stream(session, stack.serve.url, 120))
            await wait_until(lambda: _running_at_least(stack, 1), "1 running")
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
            async with session.post(stack.serve.url + "/v1/completions", json=body,
                                    headers=AUTH) as r:
                assert r.status == 503, await r.text()
                assert "Retry-After" in r.headers
                assert (await r.json())["error"]["code"] == "queue_full"
            assert await long == 120
        await restore(stack)
        async with aiohttp.ClientSession() as session:  # the 503 path is off again
            assert await stream(session, stack.serve.url, 4) == 4
    asyncio.run(main())


def test_flipping_the_sample_ratio_changes_what_the_collector_receives(stack, receiver):
    async def complete(index, tag):
        body = {"model": MODEL, "prompt": f"trace {tag}", "max_tokens": 2}
        status, reply = await api(stack, "POST", "/v1/completions", index, json=body,
                                  headers=AUTH)
        assert status == 200, reply
        return reply["id"]

    def ids_received(spans):
        return {s.attributes.get("gen_ai.response.id") for s in spans
                if s.service == "folio-api"}

    async def main():
        stack.write(observability={"trace_sample_ratio": 0.0})
        stack.serve.proc.send_signal(signal.SIGHUP)  # the launcher passes it on

        async def applied():
            return all([(await running_config(stack, i))["observability"]
                        ["trace_sample_ratio"] == 0.0 for i in (0, 1)])
        await wait_until(applied, "ratio 0 in both API processes")
        unsampled = [await complete(i, "off") for i in (0, 1)]
        await restore(stack)
        sampled = [await complete(i, "on") for i in (0, 1)]
        return unsampled, sampled

    unsampled, sampled = asyncio.run(main())
    # each API process exports its spans in the order they end: once the later,
    # sampled requests' spans are in, the earlier ones would have been too
    spans = receiver.wait_for(lambda spans: set(sampled) <= ids_received(spans))
    assert not set(unsampled) & ids_received(spans)
    reloads = [s for s in spans if s.name == "config.reload"]
    assert {s.attributes["folio.config.trigger"] for s in reloads} >= {"SIGHUP", "api"}
    assert all(s.service == "folio-engine-core" for s in reloads)
    assert "SIGHUP: reloading the config" in stack.serve.output()


def test_a_restart_only_key_is_refused_by_name_and_serving_goes_on(stack):
    async def main():
        stack.write(model={"dtype": "bfloat16"}, memory={"block_size": 32},
                    scheduler={"max_num_seqs": 3})
        status, body = await reload(stack)
        assert status == 400, body
        error = body["error"]
        assert error["code"] == "restart_required"
        assert error["param"] == "model.dtype,memory.block_size"
        assert "model.dtype" in error["message"] and "memory.block_size" in error["message"]
        for index in (0, 1):  # all-or-nothing: the live key did not change either
            assert (await running_config(stack, index))["scheduler"]["max_num_seqs"] == 8
        assert (await health(stack))["max_num_seqs"] == 8
        async with aiohttp.ClientSession() as session:
            assert await stream(session, stack.serve.url, 8) == 8
        await restore(stack)
    asyncio.run(main())
    assert "config reload refused" in stack.serve.output()


def test_a_syntax_error_or_a_bad_value_changes_nothing(stack):
    async def main():
        stack.path.write_text("scheduler: [max_num_seqs: 3\n")
        status, body = await reload(stack)
        assert status == 400 and body["error"]["code"] == "invalid_config", body
        assert "not valid YAML" in body["error"]["message"]
        assert "folio.yaml" in body["error"]["message"]
        stack.write(scheduler={"max_num_seqs": 0})
        status, body = await reload(stack, index=1)
        assert status == 400 and body["error"]["param"] == "scheduler.max_num_seqs", body
        assert (await running_config(stack, 0))["scheduler"]["max_num_seqs"] == 8
        async with aiohttp.ClientSession() as session:
            assert await stream(session, stack.serve.url, 8) == 8
        await restore(stack)
    asyncio.run(main())
    output = stack.serve.output()
    assert "scheduler.max_num_seqs" in output and str(stack.path) in output


def test_twenty_rapid_edits_under_load_lose_no_request(stack):
    async def main():
        async with aiohttp.ClientSession() as session:
            load = [asyncio.create_task(stream(session, stack.serve.url, 30 + i))
                    for i in range(16)]
            for i in range(20):
                stack.write(scheduler={"max_num_seqs": 2 + i % 7,
                                       "max_num_batched_tokens": 256 + 64 * (i % 3)},
                            observability={"trace_sample_ratio": (i % 2) * 1.0})
                if i % 5 == 4:  # some by the route as well as by the file watch
                    status, body = await reload(stack, index=i % 2)
                    assert status == 200, body
                await asyncio.sleep(0.02)
            counts = await asyncio.gather(*load)
        assert counts == [30 + i for i in range(16)]
        status, _ = await reload(stack)  # the last edit, whatever the watch coalesced
        assert status == 200
        for index in (0, 1):
            config = await running_config(stack, index)
            assert config["scheduler"]["max_num_seqs"] == 2 + 19 % 7
        await restore(stack)
    asyncio.run(main())
