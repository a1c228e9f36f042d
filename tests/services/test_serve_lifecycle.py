"""`folio serve` under failure and shutdown: a service killed mid-stream, SIGTERM with
streams in flight, and start-up errors. Each test runs its own stack of real processes."""
import asyncio
import os
import signal
import socket
import time

import aiohttp
import pytest

from observability.process_stats import is_running
from tests.services.serve_process import ServeProcess, write_config
from tests.services.test_serve_e2e import MODEL, sse_payloads

STREAM = {"model": MODEL, "prompt": "Count with me", "max_tokens": 900, "ignore_eos": True,
          "stream": True}


@pytest.fixture
def start_stack(tiny_llama_dir, default_model_path, tmp_path):
    started = []

    def start(**sections) -> ServeProcess:
        config = write_config(tmp_path / "folio.yaml", str(tiny_llama_dir),
                              str(default_model_path), **sections)
        serve = ServeProcess(config, tmp_path)
        started.append(serve)
        serve.wait_ready()
        return serve

    yield start
    for serve in started:  # never leave a stack behind, whatever the test did
        if serve.proc.poll() is None:
            serve.stop()


async def open_streams(session, serve: ServeProcess, body: dict, n: int = 3) -> list:
    """``n`` streaming requests, each past its first chunk."""
    streams = [await session.post(serve.url + "/v1/completions", json=body)
               for _ in range(n)]
    for r in streams:
        await r.content.readline()
    return streams


def assert_nothing_left(serve: ServeProcess) -> None:
    left = [p for p in serve.child_pids if is_running(p)]
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize("victim", ["services.worker_service", "services.engine_core_service"])
def test_killed_service_ends_streams_with_errors_and_stops_the_stack(start_stack, victim):
    serve = start_stack()

    async def main():
        async with aiohttp.ClientSession() as s:
            streams = await open_streams(s, serve, STREAM)
            os.kill(serve.pid_of(victim), signal.SIGKILL)
            for r in streams:
                payloads = await asyncio.wait_for(sse_payloads(r), 20)
                assert "[DONE]" not in payloads
                assert payloads[-1]["error"]["code"] == "engine_unavailable"
            async with s.post(serve.url + "/v1/completions",
                              json={"model": MODEL, "prompt": "x"}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["type"] == "service_unavailable"
            async with s.get(serve.url + "/health") as r:
                assert r.status == 503

    t0 = time.monotonic()
    asyncio.run(main())
    status = serve.wait(timeout=30)
    assert status != 0 and time.monotonic() - t0 < 30
    died = "worker" if victim == "services.worker_service" else "engine-core"
    assert f"{died} died" in serve.output()
    assert_nothing_left(serve)


def test_sigterm_drains_in_flight_streams_then_exits_zero(start_stack):
    serve = start_stack()
    drain_stream = {**STREAM, "max_tokens": 300}

    async def main():
        async with aiohttp.ClientSession() as s:
            streams = await open_streams(s, serve, drain_stream)
            serve.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with s.post(serve.url + "/v1/completions",
                              json={"model": MODEL, "prompt": "x"}) as r:
                assert r.status == 503  # draining: no new work
                assert (await r.json())["error"]["code"] == "shutting_down"
            for r in streams:
                payloads = await asyncio.wait_for(sse_payloads(r), 60)
                assert payloads[-1] == "[DONE]"
                assert payloads[-2]["choices"][0]["finish_reason"] == "length"

    asyncio.run(main())
    assert serve.wait(timeout=60) == 0, serve.output()[-3000:]
    assert_nothing_left(serve)


def test_start_up_failures_exit_non_zero_with_one_message(tmp_path, tiny_llama_dir,
                                                          default_model_path):
    missing = write_config(tmp_path / "missing.yaml", str(tmp_path / "no-such-model.gguf"),
                           str(default_model_path))
    serve = ServeProcess(missing, tmp_path)
    assert serve.wait(timeout=60) == 1
    assert "worker exited with status 1 during start-up" in serve.output()
    assert "no-such-model.gguf" in serve.output()

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(tmp_path / "busy.yaml", str(tiny_llama_dir),
                              str(default_model_path), services={"api_port": port})
        serve = ServeProcess(config, tmp_path)
        assert serve.wait(timeout=60) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in serve.output()

    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler:\n  max_num_seqs: many\n")
    serve = ServeProcess(bad, tmp_path)
    assert serve.wait(timeout=60) == 2
    assert "scheduler.max_num_seqs" in serve.output()
