"""The body rate: how many request-body bytes a second one tenant may send.

Each body costs the API process's event loop in proportion to its size (reading it,
decoding it, scanning and parsing it): about 20 ms for a 4 MB prompt here. One tenant
sending 4 MB bodies back to back, each refused in the end, keeps the loop busy and
every other tenant's first token waits behind it. A token bucket per tenant (one per
API key; without keys, one for everybody) bounds that:

    capacity   ``api.tenant_body_burst_bytes``: what a tenant may send at once
    refill     ``api.tenant_body_bytes_per_s``; 0 turns the bucket off

A body whose Content-Length the bucket cannot cover now gets 429 + ``Retry-After`` (the
seconds until it could) before a byte is read; a chunked body is charged what it
turned out to be once read, so its tenant may go into debt and wait longer next time.
Buckets are per API process: with ``services.num_api_servers`` processes a tenant may
send that many times the rate.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from services.api.openai_protocol import APIError


def rate_limited(retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, "too many request-body bytes from this API key; retry in "
                    f"{seconds} s", "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(seconds)})


class BodyRate:
    """Per-tenant token buckets over request-body bytes."""

    def __init__(self, bytes_per_s: int, burst_bytes: int,
                 clock: Callable[[], float] = time.monotonic):
        self.bytes_per_s = bytes_per_s
        self.burst_bytes = burst_bytes
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (level, at)
        self.num_refused = 0

    def _level(self, tenant: str, now: float) -> float:
        level, at = self._buckets.get(tenant, (self.burst_bytes, now))
        return min(self.burst_bytes, level + (now - at) * self.bytes_per_s)

    def take(self, tenant: str | None, num_bytes: int, may_borrow: bool = False) -> None:
        """Charge ``num_bytes`` to the tenant; 429 (nothing charged) when its bucket
        cannot cover them, unless ``may_borrow`` (a body already read)."""
        if self.bytes_per_s <= 0 or num_bytes <= 0:
            return
        key, now = tenant or "", self.clock()
        level = self._level(key, now)
        if level < num_bytes and not may_borrow:
            self.num_refused += 1
            raise rate_limited((num_bytes - level) / self.bytes_per_s)
        self._buckets[key] = (level - num_bytes, now)
        if len(self._buckets) > 100_000:  # tenants are API keys: a few; stay bounded
            self._forget_full(now)

    def _forget_full(self, now: float) -> None:
        for key in [k for k in self._buckets if self._level(k, now) >= self.burst_bytes]:
            del self._buckets[key]
