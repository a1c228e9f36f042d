"""Issue 14: one tenant's stream of 4 MB bodies cannot keep the API's event loop for
itself; past its body-byte rate a body is held unread until the rate covers it (up to
api.tenant_body_max_wait_s), or else gets 429 + Retry-After before a byte is read, and
another tenant is served as before."""
import asyncio
import contextlib
import json

import aiohttp
import pytest

from config.schema import APIConfig
from services.api.body_rate import BodyRate
from services.api.openai_protocol import APIError
from tests.services.api_harness import api_server
from tests.services.test_api_connections import metrics

A, B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"


BIG = json.dumps({"prompt": "Hi", "user": "u" * 60_000, "max_tokens": 2})  # ~60 KB


@contextlib.asynccontextmanager
async def _two_tenants(tokenizer, limits: APIConfig):
    """(url, engine, client session) of an API with tenants A and B under ``limits``."""
    async with api_server(tokenizer, limits, keys=(A, B)) as (url, engine):
        async with aiohttp.ClientSession() as session:
            yield url, engine, session


async def _post(session: aiohttp.ClientSession, url: str, key: str, data: str):
    """(status, Retry-After, JSON body) of a completion request under ``key``."""
    async with session.post(url + "/v1/completions", data=data, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
        return r.status, r.headers.get("Retry-After"), await r.json()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_bucket_refills_at_its_rate_and_refuses_what_it_cannot_cover():
    clock = Clock()
    rate = BodyRate(bytes_per_s=1000, burst_bytes=3000, clock=clock)
    rate.take("a", 3000)
    with pytest.raises(APIError) as refused:
        rate.take("a", 500)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    rate.take("b", 3000)  # another tenant has its own bucket
    clock.now = 0.5
    rate.take("a", 500)  # refilled 500 bytes in half a second
    with pytest.raises(APIError) as refused:
        rate.take("a", 2500)
    assert refused.value.headers["Retry-After"] == "3"  # 2500 bytes at 1000/s
    rate.take("a", 2500, may_borrow=True)  # a chunked body already read: debt
    clock.now = 3.0
    with pytest.raises(APIError):
        rate.take("a", 100)  # still repaying
    clock.now = 10.0
    rate.take("a", 3000)  # full again, never above the burst
    assert rate.num_refused == 3


def _held_rate(clock: Clock, slept: list[float], meanwhile=None) -> BodyRate:
    """A bucket of 1000 bytes/s (burst 3000, waits up to 2 s) whose sleeps advance
    ``clock``; ``meanwhile(rate)`` runs at the end of the first sleep (another request
    taking bytes just before the sleeper wakes)."""
    async def sleep(seconds):
        slept.append(seconds)
        clock.now += seconds
        if meanwhile is not None and len(slept) == 1:
            meanwhile(rate)

    rate = BodyRate(bytes_per_s=1000, burst_bytes=3000, max_wait_s=2.0, clock=clock,
                    sleep=sleep)
    return rate


def test_a_body_the_rate_covers_within_the_wait_is_held_then_charged():
    clock, slept = Clock(), []
    rate = _held_rate(clock, slept)

    async def main():
        await rate.admit("a", 3000)  # the burst: no wait
        await rate.admit("a", 1500)  # 1.5 s until the bucket covers it
        assert slept == [1.5] and clock.now == 1.5
        with pytest.raises(APIError) as refused:
            await rate.admit("a", 2500)  # 2.5 s away: past the wait, nothing charged
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "3"
        clock.now = 1.6
        await rate.admit("a", 100)  # a small body is not queued behind anything
        await rate.admit("b", 3000)  # another tenant's bucket is full
        assert slept == [1.5]
    asyncio.run(main())
    assert (rate.num_held, rate.num_refused) == (1, 1)


def test_a_held_body_whose_bytes_were_taken_meanwhile_waits_again_within_its_limit():
    clock, slept = Clock(), []
    rate = _held_rate(clock, slept, meanwhile=lambda r: r.take("a", 600))

    async def main():
        await rate.admit("a", 3000)
        await rate.admit("a", 1000)  # 1 s; meanwhile another body takes 600 bytes
        assert slept == [1.0, 0.6] and clock.now == 1.6
    asyncio.run(main())
    assert rate.num_held == 1  # counted once

    clock, slept = Clock(), []
    rate = _held_rate(clock, slept, meanwhile=lambda r: r.take("a", 1500, may_borrow=True))

    async def refused():
        await rate.admit("a", 3000)
        with pytest.raises(APIError):  # 1 s, then 1.5 s more: past the 2 s wait
            await rate.admit("a", 1000)
    asyncio.run(refused())


def test_a_small_body_passes_while_a_large_one_waits():
    """A waiting body charges nothing until the bucket covers it (no debt to queue
    behind), so the tenant's small requests are not held up by its large ones."""
    rate = BodyRate(bytes_per_s=100_000, burst_bytes=100_000, max_wait_s=1.0)

    async def main():
        loop = asyncio.get_running_loop()
        await rate.admit("a", 100_000)  # the bucket is empty now
        t0 = loop.time()
        large = asyncio.ensure_future(rate.admit("a", 50_000))  # 0.5 s away
        await asyncio.sleep(0.05)
        await rate.admit("a", 1_000)  # ~5,000 bytes refilled: enough for this one
        assert loop.time() - t0 < 0.3
        await large
        assert loop.time() - t0 >= 0.45
    asyncio.run(main())
    assert rate.num_held == 1


def test_a_body_refused_for_its_size_costs_its_tenant_what_it_declared():
    clock, slept = Clock(), []
    rate = _held_rate(clock, slept)

    async def main():
        await rate.charge_refused("a", 2000)  # within the burst: answered at once
        await rate.charge_refused("a", 10**9)  # one burst's worth: 2 s away, held
        assert slept == [2.0]
        await rate.charge_refused("a", 3000)  # 3 s away: past the wait, charged at once
        assert slept == [2.0]
        with pytest.raises(APIError):  # 3000 bytes of debt: the next body is 4 s away
            await rate.admit("a", 1000)
        await rate.admit("b", 1000)
    asyncio.run(main())
    assert (rate.num_held, rate.num_refused) == (1, 1)


def test_off_when_the_rate_is_zero():
    rate = BodyRate(bytes_per_s=0, burst_bytes=10)
    for _ in range(10):
        rate.take("a", 10**9)


def test_a_tenant_over_its_rate_gets_429_and_another_is_served(smollm_tokenizer):
    limits = APIConfig(max_body_bytes=64 * 1024, tenant_body_bytes_per_s=64 * 1024,
                       tenant_body_burst_bytes=128 * 1024, tenant_body_max_wait_s=0.0)

    async def main():
        async with _two_tenants(smollm_tokenizer, limits) as (url, engine, s):
            async def post(key):
                return await _post(s, url, key, BIG)
            statuses = [await post(A) for _ in range(4)]
            assert [s for s, _, _ in statuses[:2]] == [200, 200]
            status, retry_after, body = statuses[2]
            assert status == 429 and int(retry_after) >= 1
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert (await post(B))[0] == 200  # B's own bucket is full
            assert len(engine.added) == 3
            m = await metrics(url, {"Authorization": f"Bearer {B}"})
            refused = sum(status == 429 for status, _, _ in statuses)
            assert m["folio:api_body_rate_refusals_total"] == refused >= 1
            assert m["folio:api_body_rate_held_total"] == 0
    asyncio.run(main())


def test_a_tenant_over_its_rate_is_slowed_to_it_and_another_is_served_at_once(
        smollm_tokenizer):
    """Bodies past the burst are answered late, at the rate, not refused; another
    tenant's request meanwhile is answered without waiting for them."""
    limits = APIConfig(max_body_bytes=64 * 1024, tenant_body_bytes_per_s=200 * 1024,
                       tenant_body_burst_bytes=64 * 1024, tenant_body_max_wait_s=2.0)

    async def main():
        async with _two_tenants(smollm_tokenizer, limits) as (url, engine, s):
            async def post(key, data):
                status, _, _ = await _post(s, url, key, data)
                return status, loop.time()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            # 6 x 60 KB: one in the burst, five at 200 KB/s, about 1.5 s in all
            flood = asyncio.gather(*(post(A, BIG) for _ in range(6)))
            await asyncio.sleep(0.2)
            b_status, b_done = await post(B, BIG)
            statuses = await flood
            assert b_status == 200 and b_done - t0 < 1.0
            assert all(status == 200 for status, _ in statuses)
            last = max(done for _, done in statuses) - t0
            assert 1.2 < last < 4.0, last  # 300 KB past the burst at 200 KB/s
            assert len(engine.added) == 7
            m = await metrics(url, {"Authorization": f"Bearer {B}"})
            assert m["folio:api_body_rate_held_total"] == 5
            assert m["folio:api_body_rate_refusals_total"] == 0
    asyncio.run(main())


def test_a_held_body_waits_at_most_half_its_read_time():
    assert APIConfig().body_hold_s == 5.0
    assert APIConfig(body_timeout_s=4.0, tenant_body_max_wait_s=5.0).body_hold_s == 2.0


def test_an_invalid_body_costs_its_tenant_four_times_its_bytes():
    from services.api.body_rate import INVALID_BODY_COST
    clock = Clock()
    rate = BodyRate(bytes_per_s=1000, burst_bytes=10_000, clock=clock)
    rate.take("a", 2000)  # read
    rate.charge_invalid("a", 2000)  # then refused: 3 x 2000 more
    assert INVALID_BODY_COST == 4 and rate.num_invalid == 1
    rate.take("a", 2000)  # 10,000 - 8,000 = 2,000 left
    with pytest.raises(APIError):
        rate.take("a", 1)
    rate.take("b", 10_000)  # another tenant's bucket is untouched
    clock.now = 10.0  # refilled
    rate.charge_invalid("a", 10**9)  # at most one burst: debt of 10,000, not 3 GB
    clock.now = 20.0
    rate.take("a", 10_000)


def test_a_refused_invalid_body_slows_its_tenant_but_not_another(smollm_tokenizer):
    """A 60 KB body refused 400 costs tenant A 240 KB of a 200 KB/s rate: A's next
    valid body is held about a second; B, and a well-formed A before, pay nothing
    extra."""
    limits = APIConfig(max_body_bytes=64 * 1024, tenant_body_bytes_per_s=200 * 1024,
                       tenant_body_burst_bytes=256 * 1024, tenant_body_max_wait_s=3.0)
    invalid = json.dumps({"prompt": "Hi", "user": "u" * 60_000, "max_tokens": -1})

    async def main():
        async with _two_tenants(smollm_tokenizer, limits) as (url, engine, s):
            loop = asyncio.get_running_loop()
            assert (await _post(s, url, A, BIG))[0] == 200
            status, _, body = await _post(s, url, A, invalid)
            assert status == 400 and body["error"]["param"] == "max_tokens"
            t0 = loop.time()
            assert (await _post(s, url, B, BIG))[0] == 200
            assert loop.time() - t0 < 0.5
            t0 = loop.time()
            assert (await _post(s, url, A, BIG))[0] == 200  # 240 + 60 + 60 KB > 256
            assert 0.4 < loop.time() - t0 < 2.5
            m = await metrics(url, {"Authorization": f"Bearer {B}"})
            assert m["folio:api_body_rate_invalid_total"] == 1
            assert m["folio:api_body_rate_held_total"] == 1
    asyncio.run(main())
