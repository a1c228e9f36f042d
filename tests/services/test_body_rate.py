"""Issue 14: one tenant's stream of 4 MB bodies cannot keep the API's event loop for
itself; past its body-byte rate it gets 429 + Retry-After before a byte is read, and
another tenant is served as before."""
import asyncio
import json

import aiohttp
import pytest

from config.schema import APIConfig
from services.api.body_rate import BodyRate
from services.api.openai_protocol import APIError
from tests.services.api_harness import api_server

A, B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"


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


def test_off_when_the_rate_is_zero():
    rate = BodyRate(bytes_per_s=0, burst_bytes=10)
    for _ in range(10):
        rate.take("a", 10**9)


def test_a_tenant_over_its_rate_gets_429_and_another_is_served(smollm_tokenizer):
    limits = APIConfig(max_body_bytes=64 * 1024, tenant_body_bytes_per_s=64 * 1024,
                       tenant_body_burst_bytes=128 * 1024)
    big = json.dumps({"prompt": "Hi", "user": "u" * 60_000, "max_tokens": 2})

    async def main():
        async with api_server(smollm_tokenizer, limits, keys=(A, B)) as (url, engine):
            async with aiohttp.ClientSession() as s:
                async def post(key):
                    async with s.post(url + "/v1/completions", data=big, headers={
                            "Authorization": f"Bearer {key}",
                            "Content-Type": "application/json"}) as r:
                        return r.status, r.headers.get("Retry-After"), await r.json()
                statuses = [await post(A) for _ in range(4)]
                assert [s for s, _, _ in statuses[:2]] == [200, 200]
                status, retry_after, body = statuses[2]
                assert status == 429 and int(retry_after) >= 1
                assert body["error"]["code"] == "rate_limit_exceeded"
                assert (await post(B))[0] == 200  # B's own bucket is full
                assert len(engine.added) == 3
    asyncio.run(main())
