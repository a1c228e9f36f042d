"""The body rate: how many request-body bytes a second one tenant may send.

Each body costs the API process's event loop in proportion to its size (reading it,
decoding it, scanning and parsing it): about 20 ms for a 4 MB prompt here. One tenant
sending 4 MB bodies back to back, each refused in the end, keeps the loop busy and
every other tenant's first token waits behind it. A token bucket per tenant (one per
API key; without keys, one for everybody) bounds that:

    capacity   ``api.tenant_body_burst_bytes``: what a tenant may send at once
    refill     ``api.tenant_body_bytes_per_s``; 0 turns the bucket off
    wait       ``api.tenant_body_max_wait_s``: how long a body may be held back (at
               most half of ``api.body_timeout_s``, which the wait counts towards)

A body whose Content-Length the bucket cannot cover now, but will within the wait, is
held, unread, until the bucket has refilled enough, and charged then: its request is
answered late, not refused, and a small body arriving meanwhile passes at once. A
client that sends bodies back to back therefore slows to the rate: its unread bytes fill
the socket's buffers, and its sends stall. Answered 429 at once instead, it sent the
next body at once, and on a 2-core machine that client's own loop (building and sending
4 MB bodies) took the CPU the server needed (README, "Hostile clients"). A body the
bucket cannot cover within the wait gets 429 + ``Retry-After`` (the seconds until it
could) before a byte is read, and nothing is charged. A body refused for its declared
size (413) is charged what it declared, its answer held the same way: aiohttp drains a
refused body to keep the connection, so a client re-sending one would otherwise cost
the loop its bytes at no rate at all. A chunked body is charged what it turned out to
be once read, so its tenant may go into debt and wait longer next time. A body read
and then refused as invalid (400: too many values, a prompt too long, a parameter past
its bound) costs ``INVALID_BODY_COST`` times its bytes, the rest as debt (at most one
burst): a client that keeps sending bodies it knows are refused slows to a fraction of
the rate, and a well-formed client never pays it. Buckets are
per API process: with ``services.num_api_servers`` processes a tenant may send that
many times the rate.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from services.api.openai_protocol import APIError


def rate_limited(retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, "too many request-body bytes from this API key; retry in "
                    f"{seconds} s", "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(seconds)})


INVALID_BODY_COST = 4  # an invalid body costs its tenant this many times its bytes


class BodyRate:
    """Per-tenant token buckets over request-body bytes."""

    def __init__(self, bytes_per_s: int, burst_bytes: int, max_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.bytes_per_s = bytes_per_s
        self.burst_bytes = burst_bytes
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.sleep = sleep
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (level, at)
        self.num_refused = 0  # answered 429
        self.num_held = 0  # held back until the bucket covered them
        self.num_invalid = 0  # read, then refused as invalid (charged INVALID_BODY_COST x)

    def _level(self, tenant: str, now: float) -> float:
        level, at = self._buckets.get(tenant, (self.burst_bytes, now))
        return min(self.burst_bytes, level + (now - at) * self.bytes_per_s)

    async def admit(self, tenant: str | None, num_bytes: int) -> None:
        """Charge a body's ``num_bytes`` before it is read, returning once the bucket
        covers them: at once, or after waits of at most ``max_wait_s`` in all; 429
        (nothing charged) when that would not do."""
        if (wait := await self._hold_until_covered(tenant, num_bytes)) > 0:
            self.num_refused += 1
            raise rate_limited(wait)

    def charge_invalid(self, tenant: str | None, num_bytes: int) -> None:
        """A body of ``num_bytes``, read and charged, was refused as invalid: charge
        its tenant ``INVALID_BODY_COST - 1`` times more (at most one burst), as debt."""
        if self.bytes_per_s <= 0:
            return
        self.num_invalid += 1
        self.take(tenant, min((INVALID_BODY_COST - 1) * num_bytes, self.burst_bytes),
                  may_borrow=True)

    async def charge_refused(self, tenant: str | None, num_bytes: int) -> None:
        """A body refused for its declared size still costs its tenant those bytes (at
        most one burst's worth: a size it never sends cannot lock it out for long), and
        its answer waits as a held body would, at most ``max_wait_s`` (then the bytes
        are charged anyway). A client that keeps sending it, unread but
        lingering-drained, slows to the rate too."""
        num_bytes = min(num_bytes, self.burst_bytes)
        if await self._hold_until_covered(tenant, num_bytes) > 0:
            self.take(tenant, num_bytes, may_borrow=True)

    async def _hold_until_covered(self, tenant: str | None, num_bytes: int) -> float:
        """Wait until the bucket covers ``num_bytes`` and charge them (0.0), or return
        the wait still needed, charging nothing, once it would pass ``max_wait_s`` in
        all. A body is counted held once, however often it waits again."""
        waited = 0.0
        while (wait := self._wait_or_take(tenant, num_bytes)) > 0:
            if waited + wait > self.max_wait_s:
                return wait
            if waited == 0:
                self.num_held += 1
            await self.sleep(wait)
            waited += wait
        return 0.0

    def _wait_or_take(self, tenant: str | None, num_bytes: int) -> float:
        """Charge ``num_bytes`` if the bucket covers them now (0.0), else the seconds
        until it would, charging nothing: a waiting body never puts the bucket in
        debt, so a small body never queues behind a large one; when waiters wake
        together, the first takes the bytes and the others wait again."""
        if self.bytes_per_s <= 0 or num_bytes <= 0:
            return 0.0
        key, now = tenant or "", self.clock()
        level = self._level(key, now)
        if level < num_bytes:
            return (num_bytes - level) / self.bytes_per_s
        self._charge(key, level - num_bytes, now)
        return 0.0

    def take(self, tenant: str | None, num_bytes: int, may_borrow: bool = False) -> None:
        """Charge ``num_bytes`` to the tenant now; 429 (nothing charged) when its
        bucket cannot cover them, unless ``may_borrow`` (the bytes came or were
        refused anyway: the bucket goes into debt)."""
        if self.bytes_per_s <= 0 or num_bytes <= 0:
            return
        key, now = tenant or "", self.clock()
        level = self._level(key, now)
        if level < num_bytes and not may_borrow:
            self.num_refused += 1
            raise rate_limited((num_bytes - level) / self.bytes_per_s)
        self._charge(key, level - num_bytes, now)

    def _charge(self, key: str, level: float, now: float) -> None:
        self._buckets[key] = (level, now)
        if len(self._buckets) > 100_000:  # tenants are API keys: a few; stay bounded
            self._forget_full(now)

    def _forget_full(self, now: float) -> None:
        for key in [k for k in self._buckets if self._level(k, now) >= self.burst_bytes]:
            del self._buckets[key]
