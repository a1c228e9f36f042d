"""`folio serve` under abuse: invalid requests mixed into valid traffic, a disconnect
storm, and garbage on every internal socket. One stack (tiny model, one API process,
sockets in a known folder) serves the module; afterwards the engine must hold no
request and every KV block must be free with reference count 0.
"""
import asyncio
import base64
import json
import os
import pickle
import random
import re
import stat
from pathlib import Path

import aiohttp
import pytest

from observability.process_stats import is_running
from services.transport import MAX_FRAME_BYTES
from tests.services.serve_process import ServeProcess, write_config
from tests.services.test_serve_e2e import MODEL, sse_payloads

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reliability")
    config = write_config(folder / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
                          memory={"num_blocks": 1024},
                          services={"socket_dir": str(folder / "sockets")})
    serve = ServeProcess(config, folder)
    serve.wait_ready()
    serve.socket_dir = folder / "sockets"
    yield serve
    assert serve.stop() == 0, serve.output()[-3000:]
    assert not any(is_running(p) for p in serve.child_pids)


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=120))


async def health(s, url) -> dict:
    async with s.get(url + "/health") as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def wait_clean(s, url, within: float = 15.0) -> dict:
    """Poll /health until no request is left anywhere and every block is unreferenced."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        h = await health(s, url)
        g = h["engine"]
        if (g["num_running"] == g["num_waiting"] == g["num_requests"] == 0
                and g["num_routed_requests"] == 0 and g["num_referenced_blocks"] == 0
                and g["num_free_blocks"] == g["num_blocks"]
                and h["api"]["num_in_flight"] == 0):
            return h
        assert asyncio.get_running_loop().time() < deadline, h
        await asyncio.sleep(0.1)


# Bad requests the API or the engine core already refuses (4xx), never a 5xx.
INVALID = [
    {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "temperature": -1},
    {"prompt": "x", "top_p": 2}, {"prompt": ""}, {"prompt": None}, {"prompt": [49152]},
    {"prompt": "x", "max_tokens": 100000},  # refused by the engine core, not the API
    {"model": "other", "prompt": "x"}, {"prompt": "x", "n": "two"},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": "x", "stream": "yes"}, {"prompt": "x", "stop": 5},
    {"prompt": "x", "temperature": "hot"}, {"prompt": "x", "seed": 1.5},
    b"{not json", b"[1, 2]", b"\xff\xfe\x00",
    ("chat", {"messages": []}), ("chat", {"messages": "hi"}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}),
]


async def _send(s, url: str, kind: str, body) -> tuple[int, dict | list]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": {"model": MODEL, **body}}
    streams = isinstance(body, dict) and body.get("stream") is True
    async with s.post(url + path, **kwargs) as r:
        if streams and r.status == 200:
            return r.status, await sse_payloads(r)
        return r.status, await r.json(content_type=None)


def _valid(i: int) -> tuple[str, dict]:
    base = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    kind = ("completion", "stream", "chat")[i % 3]
    if kind == "chat":
        return "chat", {**base, "messages": [{"role": "user", "content": f"Hi {i}"}]}
    if kind == "stream":
        return "completion", {**base, "prompt": f"Request number {i}", "stream": True,
                              "stream_options": {"include_usage": True}}
    return "completion", {**base, "prompt": f"Request number {i}"}


def _check_valid(kind: str, body: dict, status: int, reply) -> None:
    assert status == 200, reply
    if body.get("stream"):
        assert reply[-1] == "[DONE]"
        assert reply[-2]["usage"]["completion_tokens"] == 3
        assert reply[-3]["choices"][0]["finish_reason"] == "length"
        # a chunk per token, or fewer carrying several (a run of decode steps)
        assert 1 <= len([p for p in reply[:-1] if p["choices"]]) <= 3
    else:
        assert reply["usage"]["completion_tokens"] == 3


def test_invalid_requests_interleaved_with_valid_ones_at_concurrency_64(stack):
    """1,000 invalid and 1,000 valid requests, 64 at a time: no 5xx, every valid one
    completes, /health answers 200 all along, and nothing is left afterwards."""
    jobs = []
    for i in range(1000):
        jobs.append(_valid(i))
        bad = INVALID[i % len(INVALID)]
        jobs.append(bad if isinstance(bad, tuple) else ("completion", bad))

    async def main():
        limit = asyncio.Semaphore(64)
        probes: list[int] = []
        done = asyncio.Event()
        async with session() as s:
            async def probe():
                while not done.is_set():
                    async with s.get(stack.url + "/health") as r:
                        probes.append(r.status)
                    await asyncio.sleep(0.1)

            async def one(kind, body):
                async with limit:
                    return await _send(s, stack.url, kind, body)

            prober = asyncio.ensure_future(probe())
            results = await asyncio.gather(*(one(k, b) for k, b in jobs))
            done.set()
            await prober
            for i, ((kind, body), (status, reply)) in enumerate(zip(jobs, results)):
                if i % 2 == 0:
                    _check_valid(kind, body, status, reply)
                else:
                    assert 400 <= status < 500, (body, status, reply)
                    assert reply["error"]["message"]
            assert len(probes) >= 5 and set(probes) == {200}, probes
            await wait_clean(s, stack.url)
    asyncio.run(main())


def test_disconnect_storm_leaves_no_request_and_no_referenced_block(stack):
    """200 concurrent streams; 40 clients hang up at a random token. The other 160
    finish whole, and the engine ends with no request and every block free."""
    rng = random.Random(0)
    num_streams, max_tokens = 200, 32
    drop_at = {i: rng.randint(1, max_tokens - 1) for i in rng.sample(range(num_streams), 40)}
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 0}

    async def one(s, i):
        async with s.post(stack.url + "/v1/completions",
                          json={**body, "prompt": f"Storm request {i}"}) as r:
            assert r.status == 200
            if i not in drop_at:
                return await sse_payloads(r)
            num_tokens = 0  # a chunk may carry several tokens (a run of decode steps)
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[len(b"data: "):])
                    if chunk["choices"]:
                        num_tokens += len(chunk["choices"][0]["logprobs"]["tokens"])
                if num_tokens >= drop_at[i]:
                    r.close()  # the client hangs up mid-stream
                    return None
            raise AssertionError(f"stream {i} ended before token {drop_at[i]}")

    async def main():
        async with session() as s:
            results = await asyncio.gather(*(one(s, i) for i in range(num_streams)))
            for i, payloads in enumerate(results):
                if i in drop_at:
                    continue
                assert payloads[-1] == "[DONE]", payloads[-3:]
                assert payloads[-2]["usage"]["completion_tokens"] == max_tokens
                assert payloads[-3]["choices"][0]["finish_reason"] == "length"
            await wait_clean(s, stack.url)
    asyncio.run(main())


class _Unpickled:
    """Unpickling this creates ``path``: a stand-in for a remote-code-execution payload."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _ws_frame(payload: bytes, declared_len: int | None = None) -> bytes:
    """A masked client binary frame; ``declared_len`` lies about the payload size."""
    n = len(payload) if declared_len is None else declared_len
    if n < 126:
        head = bytes([0x82, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([0x82, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x82, 0x80 | 127]) + n.to_bytes(8, "big")
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def _close_code_after(path: Path, frame: bytes) -> int:
    """Open a WebSocket on a unix socket by hand, send ``frame``, return the close code
    the service answers with (its first frames, WorkerReady etc., are skipped)."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(f"GET /ws HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
                     f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                     f"Sec-WebSocket-Version: 13\r\n\r\n".encode())
        assert b" 101 " in (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")[0]
        writer.write(frame)
        while True:  # server frames are unmasked: opcode, length, payload
            b0, b1 = await asyncio.wait_for(reader.readexactly(2), 10)
            n = b1 & 0x7F
            if n >= 126:
                n = int.from_bytes(await reader.readexactly(2 if n == 126 else 8), "big")
            payload = await reader.readexactly(n)
            if b0 & 0x0F == 0x8:
                return int.from_bytes(payload[:2], "big")
    finally:
        writer.close()


async def _raw_reply(path: Path, data: bytes) -> bytes:
    """Send bytes that are not HTTP at all; what comes back before the socket closes."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def test_internal_sockets_are_private_and_survive_garbage_pickles_and_huge_frames(
        stack, tmp_path):
    sockets = {name: stack.socket_dir / f"{name}.sock"
               for name in ("engine-core", "worker", "api-0")}
    assert stat.S_IMODE(stack.socket_dir.stat().st_mode) == 0o700
    for path in sockets.values():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    marker = tmp_path / "unpickled"
    garbage = random.Random(1).randbytes(2048)
    pids = {m: stack.pid_of(m) for m in ("services.worker_service",
                                        "services.engine_core_service", "services.api")}
    errors_before = stack.output().count("protocol error")

    async def main():
        for name in ("engine-core", "worker"):
            path = sockets[name]
            assert await _close_code_after(path, _ws_frame(garbage)) == 1003
            assert await _close_code_after(path, _ws_frame(pickle.dumps(
                _Unpickled(marker)))) == 1003
            oversized = _ws_frame(b"", declared_len=MAX_FRAME_BYTES + 1)
            assert await _close_code_after(path, oversized) == 1009
        for path in sockets.values():  # not even HTTP
            reply = await _raw_reply(path, garbage)
            assert reply == b"" or b" 400 " in reply.split(b"\r\n")[0], reply[:100]
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(sockets["api-0"]))) as s:
            url = "http://localhost/v1/completions"
            async with s.post(url, data=pickle.dumps(_Unpickled(marker))) as r:
                assert r.status == 400
            async with s.post(url, data=b"x" * (8 * 1024 * 1024)) as r:  # over the limit
                assert 400 <= r.status < 500
            async with s.get("http://localhost/health", headers={"X-Big": "y" * 100_000}) as r:
                assert 400 <= r.status < 500  # an oversized header line
        async with session() as s:  # everything still serves
            async with s.post(stack.url + "/v1/completions", json={
                    "model": MODEL, "prompt": "still alive", "max_tokens": 2}) as r:
                assert r.status == 200
            h = await wait_clean(s, stack.url)
            # the fuzzing links are gone: the engine core notices a closed link on its
            # own loop and /health is a snapshot published every 100 ms, so poll
            deadline = asyncio.get_running_loop().time() + 10
            while h["engine"]["num_clients"] != 1:
                assert asyncio.get_running_loop().time() < deadline, h["engine"]
                await asyncio.sleep(0.1)
                h = await health(s, stack.url)

    asyncio.run(main())
    assert not marker.exists()  # nothing was unpickled
    assert all(is_running(pid) for pid in pids.values())
    # 3 bad frames x 2 WebSocket services + 3 non-HTTP connections + the long header
    assert stack.output().count("protocol error") - errors_before >= 10, \
        stack.output()[-3000:]


_UNPICKLING = re.compile(r"\bpickle\.(loads?|Unpickler)\b|\b(cPickle|dill|jsonpickle|shelve)\b"
                         r"|\bmarshal\.loads?\b|allow_pickle\s*=\s*True|\btorch\.load\(")


def test_no_code_path_unpickles():
    """Nothing Folio runs deserialises with pickle (or torch.load, which unpickles)."""
    offenders = []
    for folder in ("config", "engine_core", "worker", "kernels", "services",
                   "observability", "folio", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _UNPICKLING.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, offenders
