"""`folio serve` supervision (issue 14, item 8): SIGTERM drains (SIGHUP reloads the
config since issue 20: tests/services/test_live_retune_e2e.py), an API process that exits
or dies is restarted while the others keep serving, a spent restart budget stops the
stack, and no exit path leaves the socket folder behind."""
import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp

from observability.process_stats import command_line, descendants, is_running
from services.transport import Endpoint, probe_health
from tests.services.serve_process import ServeProcess
from tests.services.test_serve_e2e import MODEL, sse_payloads
from tests.services.test_serve_lifecycle import assert_nothing_left, open_streams

STREAM = {"model": MODEL, "prompt": "Count with me", "max_tokens": 60,
          "ignore_eos": True, "stream": True}


def socket_dir_of(serve: ServeProcess) -> Path:
    """The private socket folder `folio serve` made (named in its children's arguments)."""
    args = command_line(serve.pid_of("services.worker_service"))
    return Path(next(a for a in args if a.startswith("services.socket_dir="))
                .split("=", 1)[1])


def api_pids(serve: ServeProcess) -> dict[int, int]:
    """API process index → pid, read afresh (restarted processes get new pids)."""
    found = {}
    for pid in descendants(serve.proc.pid):
        args = command_line(pid)
        if "services.api" in args and is_running(pid):
            found[int(args[args.index("--index") + 1])] = pid
    return found


async def api_health(socket_dir: Path, index: int) -> tuple[int, dict]:
    return await probe_health(Endpoint(unix_path=str(socket_dir / f"api-{index}.sock")))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


async def async_wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_sigterm_drains_streams_and_removes_the_socket_folder(start_stack):
    serve = start_stack(services={"drain_timeout_s": 90})
    folder = socket_dir_of(serve)
    assert folder.is_dir()

    async def main():
        async with aiohttp.ClientSession() as s:
            streams = await open_streams(s, serve, STREAM, n=4)
            serve.proc.send_signal(signal.SIGTERM)
            for r in streams:
                payloads = await asyncio.wait_for(sse_payloads(r), 60)
                assert payloads[-1] == "[DONE]"

    asyncio.run(main())
    assert serve.wait(timeout=60) == 0, serve.output()[-3000:]
    assert "draining: new requests get 503" in serve.output()
    assert not folder.exists()
    assert_nothing_left(serve)


def test_dead_api_process_is_restarted_while_the_other_keeps_serving(start_stack):
    serve = start_stack(services={"num_api_servers": 2, "api_restart_budget": 3})
    folder = socket_dir_of(serve)
    before = api_pids(serve)
    assert sorted(before) == [0, 1]

    async def main():
        async with aiohttp.ClientSession() as s:
            streams = await open_streams(s, serve, STREAM, n=8)
            # streams the killed process does not hold
            survivors = int((await api_health(folder, 1))[1]["api"]["num_in_flight"])
            os.kill(before[0], signal.SIGKILL)
            done = 0
            for r in streams:
                try:
                    payloads = await asyncio.wait_for(sse_payloads(r), 60)
                    done += payloads[-1] == "[DONE]"
                except aiohttp.ClientError:
                    pass  # a stream of the killed process
            assert done >= survivors  # the other process's streams were not cut
            wait_for(lambda: sorted(api_pids(serve)) == [0, 1]
                     and api_pids(serve)[0] != before[0], 60, "api-0's restart")

            async def healthy(index: int) -> bool:
                return (await api_health(folder, index))[0] == 200

            await async_wait_for(lambda: healthy(0), 60, "api-0's health")
            # SIGTERM to one API process: it drains, exits 0, and is restarted too
            os.kill(before[1], signal.SIGTERM)
            wait_for(lambda: api_pids(serve).get(1, before[1]) != before[1], 60,
                     "api-1's restart")
            await async_wait_for(lambda: healthy(1), 60, "api-1's health")
            for _ in range(6):  # both processes serve (the port is shared)
                async with s.post(serve.url + "/v1/completions",
                                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}) as r:
                    assert r.status == 200

    asyncio.run(main())
    out = serve.output()
    assert "api-0 exited (status -9); restarting it" in out
    assert "api-1 exited (status 0); restarting it" in out
    assert serve.proc.poll() is None  # the stack never stopped
    assert serve.stop() == 0
    assert not folder.exists()


def test_spent_restart_budget_stops_the_stack(start_stack):
    serve = start_stack(services={"api_restart_budget": 1})
    folder = socket_dir_of(serve)
    first = api_pids(serve)[0]
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: api_pids(serve).get(0, first) != first, 60, "the restart")
    os.kill(api_pids(serve)[0], signal.SIGKILL)
    assert serve.wait(timeout=60) == 1
    assert "restart budget (services.api_restart_budget) is spent" in serve.output()
    assert not folder.exists()
    assert_nothing_left(serve)


def test_killed_supervisor_leaves_no_socket_folder(start_stack):
    serve = start_stack()
    folder = socket_dir_of(serve)
    children = descendants(serve.proc.pid)
    serve.proc.kill()
    serve.proc.wait(10)
    wait_for(lambda: not any(is_running(p) for p in children), 30, "the children to exit")
    assert not folder.exists()
