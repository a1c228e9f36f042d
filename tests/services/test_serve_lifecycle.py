"""`folio serve` under failure and shutdown: a service killed or hung with 20 streams in
flight, SIGTERM with 20 streams in flight, and start-up errors. Each test runs its own
stack of real processes."""
import asyncio
import os
import shutil
import signal
import socket
import time

import aiohttp
import pytest

from observability.process_stats import is_running
from tests.services.serve_process import ServeProcess, processes_using, write_config
from tests.services.test_serve_e2e import MODEL, sse_payloads

STREAM = {"model": MODEL, "prompt": "Count with me", "max_tokens": 900, "ignore_eos": True,
          "stream": True}
NUM_STREAMS = 20


async def open_streams(session, serve: ServeProcess, body: dict,
                       n: int = NUM_STREAMS) -> list:
    """``n`` concurrent streaming requests, each past its first chunk."""
    streams = await asyncio.gather(*(session.post(serve.url + "/v1/completions", json=body)
                                     for _ in range(n)))
    for r in streams:
        assert r.status == 200
        await r.content.readline()
    return streams


async def assert_engine_lost(session, serve: ServeProcess, streams: list) -> None:
    """Every open stream ends with an error event; new requests and /health get 503."""
    for r in streams:
        payloads = await asyncio.wait_for(sse_payloads(r), 20)
        assert "[DONE]" not in payloads
        assert payloads[-1]["error"]["code"] == "engine_unavailable"
    async with session.post(serve.url + "/v1/completions",
                            json={"model": MODEL, "prompt": "x"}) as r:
        assert r.status == 503
        assert (await r.json())["error"]["type"] == "service_unavailable"
    async with session.get(serve.url + "/health") as r:
        assert r.status == 503


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
            await assert_engine_lost(s, serve, streams)

    t0 = time.monotonic()
    asyncio.run(main())
    status = serve.wait(timeout=30)
    assert status != 0 and time.monotonic() - t0 < 30
    died = "worker" if victim == "services.worker_service" else "engine-core"
    assert f"{died} died" in serve.output()
    assert_nothing_left(serve)


def test_hung_worker_is_caught_by_the_step_watchdog_and_the_stack_fails(start_stack):
    """SIGSTOP freezes the worker mid-stream: its process still exists, but no step
    finishes. /health turns 503 and the stack exits 1 after services.step_timeout_s."""
    serve = start_stack(services={"step_timeout_s": 3})
    worker = serve.pid_of("services.worker_service")

    async def main():
        async with aiohttp.ClientSession() as s:
            streams = await open_streams(s, serve, STREAM)
            async with s.get(serve.url + "/health") as r:
                assert r.status == 200
            os.kill(worker, signal.SIGSTOP)
            t0 = time.monotonic()
            while True:  # progress, not process existence, decides health
                async with s.get(serve.url + "/health") as r:
                    if r.status == 503:
                        break
                assert time.monotonic() - t0 < 15, "health stayed 200 for a hung worker"
                await asyncio.sleep(0.2)
            assert time.monotonic() - t0 >= 2.0  # not before the watchdog's timeout
            await assert_engine_lost(s, serve, streams)

    t0 = time.monotonic()
    try:
        asyncio.run(main())
        status = serve.wait(timeout=30)
    finally:
        if is_running(worker):
            os.kill(worker, signal.SIGCONT)
    assert status == 1 and time.monotonic() - t0 < 30
    out = serve.output()
    assert "did not finish step" in out and "services.step_timeout_s" in out
    assert "engine-core died" in out
    assert_nothing_left(serve)


def test_sigterm_drains_in_flight_streams_then_exits_zero(start_stack):
    serve = start_stack(services={"drain_timeout_s": 60})
    drain_stream = {**STREAM, "max_tokens": 60}

    async def main() -> float:
        async with aiohttp.ClientSession() as s:
            streams = await open_streams(s, serve, drain_stream)
            serve.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            await asyncio.sleep(0.2)
            async with s.post(serve.url + "/v1/completions",
                              json={"model": MODEL, "prompt": "x"}) as r:
                assert r.status == 503  # draining: no new work
                assert (await r.json())["error"]["code"] == "shutting_down"
            for r in streams:
                payloads = await asyncio.wait_for(sse_payloads(r), 60)
                assert payloads[-1] == "[DONE]"
                assert payloads[-2]["choices"][0]["finish_reason"] == "length"
            return time.monotonic() - t0

    assert asyncio.run(main()) < 60  # every stream finished within the drain timeout
    assert serve.wait(timeout=60) == 0, serve.output()[-3000:]
    assert_nothing_left(serve)


def _fails_to_start(config, tmp_path, status: int, message: str) -> str:
    """`folio serve` exits ``status`` within 60 s, ``message`` appears once, with no
    traceback, and no process of the stack is left."""
    serve = ServeProcess(config, tmp_path)
    assert serve.wait(timeout=60) == status
    out = serve.output()
    assert out.count(message) == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not processes_using(config)
    return out


def test_start_up_failures_exit_non_zero_with_one_message(tmp_path, tiny_llama_dir,
                                                          default_model_path):
    tok = str(default_model_path)
    missing = write_config(tmp_path / "missing.yaml", str(tmp_path / "no-such-model.gguf"),
                           tok)
    out = _fails_to_start(missing, tmp_path, 1, "no-such-model.gguf")
    assert "worker exited with status 1 during start-up" in out

    corrupt = tmp_path / "corrupt-model"
    shutil.copytree(tiny_llama_dir, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # a copy cut short
    config = write_config(tmp_path / "corrupt.yaml", str(corrupt), tok)
    out = _fails_to_start(config, tmp_path, 1, "not a readable safetensors file")
    assert "corrupt or incomplete" in out and str(weights) in out

    # 100 kB hold 12 blocks of the tiny model; one 1024-token sequence needs 65
    config = write_config(tmp_path / "small-kv.yaml", str(tiny_llama_dir), tok,
                          memory={"num_blocks": None, "kv_cache_bytes": 100_000})
    out = _fails_to_start(config, tmp_path, 1, "KV cache too small")
    assert "raise memory.kv_cache_bytes or lower model.max_model_len" in out

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(tmp_path / "busy.yaml", str(tiny_llama_dir), tok,
                              services={"api_port": port})
        _fails_to_start(config, tmp_path, 1, f"cannot listen on 127.0.0.1:{port}")

    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler:\n  max_num_seqs: many\n")
    _fails_to_start(bad, tmp_path, 2, "scheduler.max_num_seqs")
    broken = tmp_path / "broken.yaml"
    broken.write_text("scheduler: [max_num_seqs: 4\n")
    _fails_to_start(broken, tmp_path, 2, "not valid YAML")
