"""Issue 14: keyless polls of /health (and a public /metrics) are paced per connection,
so a client flooding them on a few keep-alive connections slows to the pace, while
requests with a key, and other connections, are not held."""
import asyncio

import aiohttp

from config.schema import APIConfig
from tests.services.api_harness import api_server
from tests.services.test_api_connections import metrics

KEY = "sk-pacing-0123456789abcdef"
INTERVAL = 0.1


async def _polls(session: aiohttp.ClientSession, url: str, count: int,
                 headers: dict | None = None) -> tuple[set[int], float]:
    loop = asyncio.get_running_loop()
    statuses, t0 = set(), loop.time()
    for _ in range(count):
        async with session.get(url + "/health", headers=headers or {}) as r:
            await r.read()
            statuses.add(r.status)
    return statuses, loop.time() - t0


def test_keyless_polls_on_one_connection_are_paced_and_keyed_ones_are_not(smollm_tokenizer):
    api = APIConfig(public_poll_interval_s=INTERVAL)

    async def main():
        async with api_server(smollm_tokenizer, api, keys=(KEY,)) as (url, _):
            one = aiohttp.TCPConnector(limit=1)  # every request on the same connection
            async with aiohttp.ClientSession(connector=one) as s:
                statuses, took = await _polls(s, url, 6)
                assert statuses == {200} and took >= 5 * INTERVAL * 0.9, took
                statuses, took = await _polls(s, url, 6, {"Authorization": f"Bearer {KEY}"})
                assert statuses == {200} and took < 2 * INTERVAL, took
            # two connections polling at once: each keeps its own pace
            async with aiohttp.ClientSession() as a, aiohttp.ClientSession() as b:
                (_, took_a), (_, took_b) = await asyncio.gather(
                    _polls(a, url, 4), _polls(b, url, 4))
                assert max(took_a, took_b) < 3 * INTERVAL * 1.5 + 0.2, (took_a, took_b)
                assert min(took_a, took_b) >= 3 * INTERVAL * 0.9
            m = await metrics(url, {"Authorization": f"Bearer {KEY}"})
            assert m["folio:api_public_polls_held_total"] == 5 + 3 + 3

    asyncio.run(main())


def test_no_pacing_when_the_interval_is_zero(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer, APIConfig(public_poll_interval_s=0),
                              keys=(KEY,)) as (url, _):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                statuses, took = await _polls(s, url, 6)
                assert statuses == {200} and took < 2 * INTERVAL, took

    asyncio.run(main())
