"""Polls without a key, paced per connection: ``/health`` and a public ``/metrics``.

Both are answered to anyone, so a client can poll them as fast as answers come back on a
few keep-alive connections (issue 14 measured 2,800 a second on 32). Each answer is
cheap, but on a 2-core machine that client's own loop, and the API process's request
parsing, take the CPU the model needs. A connection's requests to these paths without a
valid key are answered at most one per ``api.public_poll_interval_s`` (50 ms): an earlier
one waits until its turn, so a flooding connection slows to 20 requests a second, while
a health checker polling every few seconds never waits (one polling every 20 ms waits
about 30 ms a poll). Requests with a valid key are never paced. The pace is per
connection (its due time lives on the connection's handler,
services/api/connection_handler.py): a client opening a connection per request pays its
handshakes instead, and ``api.max_connections`` bounds how many it holds at once.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from services.api.auth import TENANT


class PublicPacing:
    """Holds a connection's keyless poll until ``interval_s`` after its previous one."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.num_held = 0  # polls that waited for their turn

    async def pace(self, request: web.BaseRequest) -> None:
        """Wait for this connection's turn, unless the request carries a valid key."""
        protocol = request.protocol
        if self.interval_s <= 0 or protocol is None or request.get(TENANT) is not None:
            return
        now = asyncio.get_running_loop().time()
        due = getattr(protocol, "public_poll_due", 0.0)
        protocol.public_poll_due = max(now, due) + self.interval_s
        if due > now:
            self.num_held += 1
            await asyncio.sleep(due - now)
