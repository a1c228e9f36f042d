"""The connection guard: how many client connections one API process keeps, and why
it ends the ones it ends.

A hostile client costs a server file descriptors and memory without sending a single
complete request: connections left idle, request heads trickled a byte at a time
(slowloris), bodies declared and never finished. The guard holds the process-wide
side of the defence (the per-connection deadlines live in connection_handler.py):

    open connections    at most ``api.max_connections``; one more is answered 503 and
                        closed before a request is read (reason ``over_limit``)
    closed connections  counted by reason (``header_timeout``, ``body_timeout``,
                        ``idle``, ``over_limit``) for /metrics, and logged at most
                        one line per reason per interval (a flood is one line)
"""
from __future__ import annotations

import asyncio
import json
import resource
from http import HTTPStatus

from aiohttp import web

from config.schema import APIConfig
from observability.logging import RateLimitedLog, get_logger
from services.api.errors import RETRY_AFTER_S
from services.api.openai_protocol import APIError

CLOSE_REASONS = ("header_timeout", "body_timeout", "idle", "over_limit")
ABORT_AFTER_S = 2.0  # a closed connection whose peer will not take our last bytes
REFUSAL_LINGER_S = 1.0  # how long a refused connection may still deliver its request
MAX_LINGERING_REFUSALS = 64  # past these, a refusal closes at once (fds are scarce)
FD_HEADROOM = 64  # descriptors kept for sockets to the engine core, logs, the listener
log = get_logger(__name__)
# idle closes in one log interval that make a warning (an idle-connection flood)
IDLE_FLOOD_EVENTS = 100


def error_bytes(err: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying ``err``, for a connection that no request
    handler is answering (a deadline passed, or the connection was refused)."""
    body = json.dumps(err.body()).encode()
    head = [f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}",
            "Content-Type: application/json; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in (err.headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def close_transport(transport: asyncio.BaseTransport, loop: asyncio.AbstractEventLoop,
                    ) -> None:
    transport.close()
    abort_later(transport, loop)


def abort_later(transport: asyncio.BaseTransport, loop: asyncio.AbstractEventLoop) -> None:
    """Abort a closed ``transport`` in ``ABORT_AFTER_S`` if it is still open: close()
    waits for the write buffer to drain, which a client that stopped reading never lets
    happen."""
    loop.call_later(ABORT_AFTER_S, _abort, transport)


def _abort(transport: asyncio.BaseTransport) -> None:
    try:
        transport.abort()  # a no-op on a transport that already closed
    except Exception:  # a transport that is gone may refuse even that
        pass


class ConnectionGuard:
    """Open-connection count, the connection limit and the close counters of one
    API process (see the module docstring)."""

    def __init__(self, api: APIConfig, log_interval_s: float = 10.0):
        self.api = api
        self.num_open = 0  # connections with a request handler, open now
        self.num_lingering_refusals = 0
        self.num_closed = dict.fromkeys(CLOSE_REASONS, 0)
        self._log = RateLimitedLog(log, log_interval_s)

    def warn_if_over_fd_limit(self) -> None:
        """Log when ``max_connections`` could exhaust the process's file descriptors
        first (then new clients get resets, not the 503)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.api.max_connections > soft - FD_HEADROOM:
            log.warning("api.max_connections is near or above the open-file limit",
                        max_connections=self.api.max_connections, open_file_limit=soft)

    def has_room(self) -> bool:
        return self.num_open < self.api.max_connections

    def opened(self) -> None:
        self.num_open += 1

    def released(self) -> None:
        self.num_open -= 1

    def closed(self, reason: str) -> None:
        """Count and log (rate-limited) one connection this process ended."""
        self.num_closed[reason] += 1
        # a keep-alive connection going idle is routine; only a flood of them warns
        self._log.event(reason, "connection closed by the server",
                        quiet_below=IDLE_FLOOD_EVENTS if reason == "idle" else 0,
                        reason=reason, num_open=self.num_open)

    def refusal(self) -> asyncio.Protocol:
        """The protocol of a connection over the limit: it answers 503 and closes."""
        self.closed("over_limit")
        return RefusedConnection(self)


# where the API app keeps its guard, for serve_api's connection handlers
CONNECTION_GUARD = web.AppKey("folio.connection_guard", ConnectionGuard)


class RefusedConnection(asyncio.Protocol):
    """A connection past ``max_connections``: 503, then closed.

    The answer is written at once, the write side shut, and whatever the client sends
    is discarded for up to ``REFUSAL_LINGER_S``: closing with its request still unread
    would reset the connection and could destroy the 503 before the client reads it.
    """

    def __init__(self, guard: ConnectionGuard):
        self.guard = guard
        self.transport = None
        self.is_lingering = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(error_bytes(APIError(
            503, "too many open connections; retry later", "service_unavailable",
            code="too_many_connections", headers={"Retry-After": str(RETRY_AFTER_S)})))
        loop = asyncio.get_running_loop()
        if (self.guard.num_lingering_refusals >= MAX_LINGERING_REFUSALS
                or not transport.can_write_eof()):
            close_transport(transport, loop)
            return
        transport.write_eof()
        self.is_lingering = True
        self.guard.num_lingering_refusals += 1
        loop.call_later(REFUSAL_LINGER_S, close_transport, transport, loop)

    def data_received(self, data: bytes) -> None:
        pass  # the request is refused unread

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.is_lingering:
            self.is_lingering = False
            self.guard.num_lingering_refusals -= 1
