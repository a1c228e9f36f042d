"""Hostile clients, bounded, for the benchmarks that check Folio survives them.

Each attack is a coroutine that keeps attacking until ``stop`` is set, and returns a
count of what it did. They are the attacks of issue 14, scaled to run on 127.0.0.1:

    bombs          4 MB prompts of digits to /v1/completions and of combining accents
                   to /tokenize (tokenizer bombs)
    slowloris      connections that send a partial request header one byte at a time
    slow_bodies    connections that declare a large body and send it very slowly
    health_flood   many connections hammering /health without a key
    stop_ids       requests with n = 16 and as many stop_token_ids as the body can hold
    heavy_tenant   one tenant's flood of long requests (the fairness workload)

One-shot versions (``one_*``) serve the soak's adversarial mix.
"""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp

BOMB_BYTES = 4 * 1024 * 1024 - 4096  # just under the default api.max_body_bytes


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    return host, int(port)


async def one_bomb(session: aiohttp.ClientSession, url: str, headers: dict,
                   rng: random.Random) -> int:
    """One tokenizer bomb; the HTTP status it got (400 expected)."""
    if rng.random() < 0.5:
        body = {"prompt": "7" * BOMB_BYTES, "max_tokens": 16}
        path = "/v1/completions"
    else:
        body = {"prompt": "a" + "\u0301" * (BOMB_BYTES // 2)}
        path = "/tokenize"
    async with session.post(url + path, data=json.dumps(body),
                            headers={**headers, "Content-Type": "application/json"}) as r:
        await r.read()
        return r.status


async def one_oversized(session: aiohttp.ClientSession, url: str, headers: dict,
                        vocab_size: int) -> int:
    """A request with n = 16 and as many stop_token_ids as the 4 MiB body holds (about
    two million); its status."""
    ids = ",".join(["1"] * ((BOMB_BYTES - 200) // 2))
    body = ('{"prompt":"Hi","n":16,"max_tokens":1,"stop_token_ids":[' + ids + "]}")
    async with session.post(url + "/v1/completions", data=body,
                            headers={**headers, "Content-Type": "application/json"}) as r:
        await r.read()
        return r.status


async def one_slow_client(url: str, hold_s: float, body_bytes: int = 100_000,
                          stop: asyncio.Event | None = None) -> str:
    """A connection that declares a body and trickles it for up to ``hold_s`` (or until
    ``stop``); how it ended."""
    host, port = _host_port(url)
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return "refused"
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {body_bytes}"
                     f"\r\n\r\n{{".encode())
        await writer.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        while loop.time() < deadline and not (stop is not None and stop.is_set()):
            await asyncio.sleep(1.0)
            writer.write(b" ")
            await writer.drain()
            if reader.at_eof():
                return "closed by server"
        return "held"
    except (ConnectionError, OSError):
        return "closed by server"
    finally:
        writer.close()


async def _repeat(concurrency: int, stop: asyncio.Event, one) -> int:
    """Run ``one(session)`` back to back in ``concurrency`` loops until ``stop``; how
    many ran."""
    sent = 0
    async with aiohttp.ClientSession() as session:
        async def loop():
            nonlocal sent
            while not stop.is_set():
                try:
                    await one(session)
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)  # refused mid-upload: an answer too
                sent += 1
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return sent


async def bombs(url: str, headers: dict, stop: asyncio.Event, concurrency: int = 4) -> int:
    rng = random.Random(0)
    return await _repeat(concurrency, stop, lambda s: one_bomb(s, url, headers, rng))


async def slowloris(url: str, stop: asyncio.Event, connections: int = 300,
                    byte_every_s: float = 1.0) -> int:
    """``connections`` slots, each holding a connection that sends a partial header one
    byte every ``byte_every_s`` and opening a new one when the server closes it; how
    many the server closed."""
    host, port = _host_port(url)
    closed = 0
    header = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode()

    async def hold_one() -> None:
        nonlocal closed
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            closed += 1
            await asyncio.sleep(byte_every_s)
            return
        try:
            i = 0
            while not stop.is_set():
                writer.write(header[i:i + 1] if i < len(header) else b"a")
                await writer.drain()
                await asyncio.sleep(byte_every_s)
                i += 1
                if reader.at_eof():
                    closed += 1
                    return
        except (ConnectionError, OSError):
            closed += 1
        finally:
            writer.close()

    async def slot() -> None:
        while not stop.is_set():
            await hold_one()

    await asyncio.gather(*(slot() for _ in range(connections)))
    return closed


async def slow_bodies(url: str, stop: asyncio.Event, connections: int = 100) -> int:
    """``connections`` slots trickling a declared 100 kB body a byte a second, each
    starting again when the server closes it; how many the server closed."""
    closed = 0

    async def slot() -> None:
        nonlocal closed
        while not stop.is_set():
            closed += await one_slow_client(url, 3600.0, stop=stop) == "closed by server"

    await asyncio.gather(*(slot() for _ in range(connections)))
    return closed


async def health_flood(url: str, stop: asyncio.Event, connections: int = 32,
                       rate: float = 2800.0) -> int:
    """``connections`` clients polling /health without a key, ``rate`` requests a second
    in all at most (the flood the issue measured)."""
    done = 0
    interval = connections / rate
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as s:
        async def loop():
            nonlocal done
            while not stop.is_set():
                t0 = asyncio.get_running_loop().time()
                async with s.get(url + "/health") as r:
                    await r.read()
                done += 1
                await asyncio.sleep(max(0.0, interval - (asyncio.get_running_loop().time()
                                                         - t0)))
        await asyncio.gather(*(loop() for _ in range(connections)))
    return done


async def stop_ids(url: str, headers: dict, stop: asyncio.Event, vocab_size: int,
                   concurrency: int = 4) -> int:
    return await _repeat(concurrency, stop,
                         lambda s: one_oversized(s, url, headers, vocab_size))


async def heavy_tenant(url: str, headers: dict, prompt_ids: list[int], num_requests: int,
                       max_tokens: int) -> int:
    """One tenant's flood of long requests, all at once, no two sharing a prefix; output
    tokens served."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int):
            # a different first token each: no request reuses another's cached prefix
            body = {"prompt": [100 + i] + prompt_ids[1:], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                return (await r.json()).get("usage", {}).get("completion_tokens", 0)
        return sum(await asyncio.gather(*(one(i) for i in range(num_requests))))


ATTACKS = {"bombs": lambda url, key, stop: bombs(url, {"Authorization": f"Bearer {key}"},
                                                 stop),
           "slowloris": lambda url, key, stop: slowloris(url, stop),
           "slow_bodies": lambda url, key, stop: slow_bodies(url, stop),
           "health_flood": lambda url, key, stop: health_flood(url, stop),
           "stop_ids": lambda url, key, stop: stop_ids(
               url, {"Authorization": f"Bearer {key}"}, stop, 49152)}


async def _run_until_signal(name: str, url: str, key: str) -> int:
    """Run one attack until SIGTERM; prints how much it did."""
    import signal
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    return await ATTACKS[name](url, key, stop)


if __name__ == "__main__":  # python benchmarks/attacks.py NAME URL KEY: its own process
    import sys
    print(asyncio.run(_run_until_signal(*sys.argv[1:4])), flush=True)
