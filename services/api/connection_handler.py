"""One client connection of the API: aiohttp's RequestHandler with deadlines, a
Transfer-Encoding check, and its own errors in OpenAI's JSON shape.

Deadlines (the connection guard, connection_guard.py, counts and logs each close):

    connected, or the previous request answered
        │ idle: nothing received yet       keepalive_timeout_s  → closed (idle)
        ▼
    first byte of a request head
        │ request line + headers           header_timeout_s     → 408, closed
        ▼
    headers complete, a body declared
        │ body, up to its last byte        body_timeout_s       → 408 unless an answer
        ▼                                                          has begun; closed
    the route runs: no deadline here (a generation takes what it takes)

A clock for a later request on the connection (a pipelined head or body) never fires
while an earlier request is being answered: it starts again from that request's end.
When a body times out, the route blocked reading it is cancelled with the connection,
so its body-budget reservation is released at once.

``Transfer-Encoding`` naming any coding but ``chunked`` (and ``identity``), such as
``gzip, chunked``, is answered 501 before any route runs: decoding it is not
implemented, and serving the body with the coding ignored would read another body than
the client sent.

aiohttp's parser enforces the header limits (``max_header_bytes`` per request line or
field, ``max_headers`` fields) and refuses malformed framing (a negative, non-numeric,
overflowing or duplicated Content-Length) before any route runs. Those errors never
reach a middleware, so ``handle_error`` answers them: 431 for header limits, 501 for
transfer codings, 400 for the rest, 500 for anything a handler let escape, all as
``{"error": {...}}`` with a fixed message. It never echoes the offending bytes, logs
only the error's type (a too-long header may hold a credential), and never shows a
traceback whatever aiohttp's debug setting.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web
from aiohttp.http import RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from observability.logging import get_logger
from services.api.connection_guard import ConnectionGuard, abort_later, error_bytes
from services.api.openai_protocol import APIError

SUPPORTED_CODINGS = frozenset({"chunked", "identity"})
log = get_logger(__name__)


class UnsupportedTransferEncoding(Exception):
    """A request's Transfer-Encoding names a coding this server does not decode."""


def has_unsupported_coding(message: RawRequestMessage) -> bool:
    return any(coding.strip().lower() not in SUPPORTED_CODINGS
               for value in message.headers.getall("Transfer-Encoding", ())
               for coding in value.split(","))


def _is_header_limit(exc: BaseException | None) -> bool:
    # aiohttp reports a request line or header field over the limit as LineTooLong and
    # too many fields as a BadHttpMessage with this message (tests pin both).
    return isinstance(exc, LineTooLong) or (
        isinstance(exc, BadHttpMessage) and "too many headers" in exc.message.lower())


def _is_coding_refused(exc: BaseException | None) -> bool:
    # The parser itself refuses a Transfer-Encoding whose last coding is not chunked
    # ("gzip", "chunked, gzip") with this message (tests pin it).
    return isinstance(exc, UnsupportedTransferEncoding) or (
        isinstance(exc, BadHttpMessage)
        and exc.message.lower().startswith("request has invalid `transfer-encoding`"))


def error_for(status: int, exc: BaseException | None) -> APIError:
    """The OpenAI-shaped error for a request aiohttp could not hand to the app."""
    if _is_header_limit(exc):
        return APIError(431, "the request line or header fields are too large or too many",
                        code="request_header_fields_too_large")
    if _is_coding_refused(exc):
        return APIError(501, "Transfer-Encoding other than chunked is not supported",
                        code="unsupported_transfer_encoding")
    if status >= 500:
        return APIError(status, "internal server error", "server_error")
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = str(status)
    return APIError(status, f"malformed HTTP request ({phrase})")


def _is_holding_its_body(request: web.BaseRequest) -> bool:
    """Whether the client sent ``Expect`` and none of its body: it waits for a 100."""
    return ("Expect" in request.headers and not request.content.is_eof()
            and request.content.total_bytes == 0)


@dataclass(slots=True, eq=False)
class _Clock:
    """One running deadline of a connection: for a request head, or for one body."""

    reason: str  # "header_timeout" or "body_timeout", as the guard counts it
    timeout: float
    started: float  # loop time; moved on when an earlier request ends (pipelining)
    payload: StreamReader | None = None  # the body a body clock waits for
    handle: asyncio.TimerHandle | None = None


class APIRequestHandler(RequestHandler):
    """aiohttp's per-connection handler with the deadlines, the Transfer-Encoding check
    and the JSON errors of the module docstring."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs):
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._head_clock: _Clock | None = None
        self._body_clock: _Clock | None = None
        self._last_request: web.BaseRequest | None = None  # the one answered last/now
        self._is_counted = False
        self.public_poll_due = 0.0  # loop time of this connection's next keyless poll

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._guard.opened()
        self._is_counted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._is_counted:
            self._is_counted = False
            self._guard.released()
        self._head_clock = self._stop(self._head_clock)
        self._body_clock = self._stop(self._body_clock)
        self._last_request = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close or self._upgraded:
            return super().data_received(data)
        num_before = self._request_count
        super().data_received(data)
        num_new = self._request_count - num_before
        if num_new:  # heads completed: their clock stops, a body's may start
            self._head_clock = self._stop(self._head_clock)
            self._refuse_codings(num_new)
            self._body_clock = self._stop(self._body_clock)
            payload = self._messages[-1][1] if self._messages else EMPTY_PAYLOAD
            if not payload.is_eof():
                self._body_clock = self._start("body_timeout",
                                               self._guard.api.body_timeout_s, payload)
        elif self._body_clock is not None:  # bytes of a body
            if self._body_clock.payload.is_eof():
                self._body_clock = self._stop(self._body_clock)
        elif data and self._head_clock is None:  # the first bytes of a head
            self._head_clock = self._start("header_timeout",
                                           self._guard.api.header_timeout_s)
            if self._keepalive_handle is not None:  # no longer idle: the head's clock rules
                self._keepalive_handle.cancel()
                self._keepalive_handle = None

    def _refuse_codings(self, num_new: int) -> None:
        """Replace each new request whose body has a coding we cannot decode by a 501
        (handle_error answers it and closes the connection)."""
        for i in range(len(self._messages) - num_new, len(self._messages)):
            message = self._messages[i][0]
            if isinstance(message, RawRequestMessage) and has_unsupported_coding(message):
                exc = UnsupportedTransferEncoding()
                self._messages[i] = (_ErrInfo(status=501, exc=exc, message=""),
                                     EMPTY_PAYLOAD)

    def _start(self, reason: str, timeout: float, payload: StreamReader | None = None,
               ) -> _Clock:
        clock = _Clock(reason, timeout, self._loop.time(), payload)
        clock.handle = self._loop.call_at(clock.started + timeout, self._on_clock, clock)
        return clock

    @staticmethod
    def _stop(clock: _Clock | None) -> None:
        if clock is not None and clock.handle is not None:
            clock.handle.cancel()
        return None

    def _on_clock(self, clock: _Clock) -> None:
        clock.handle = None
        if self.transport is None or clock not in (self._head_clock, self._body_clock):
            return
        deadline = clock.started + clock.timeout
        if self._loop.time() < deadline:  # moved on since it was armed
            clock.handle = self._loop.call_at(deadline, self._on_clock, clock)
        elif not self._request_in_progress or self._is_answering(clock):
            self._expire(clock)
        # else an earlier request is being answered: _handle_request re-arms the clock

    def _is_answering(self, clock: _Clock) -> bool:
        """Whether the request being answered now is the one whose body ``clock`` waits
        for (the route reads the body itself)."""
        request = self._last_request
        return (clock.payload is not None and request is not None
                and request.content is clock.payload)

    def _expire(self, clock: _Clock) -> None:
        """End the connection for a passed deadline: 408 first if nothing of an
        answer to that request was sent."""
        if not (self._is_answering(clock) and self._last_request.writer.output_size > 0):
            what = "request headers" if clock.payload is None else "request body"
            self.transport.write(error_bytes(APIError(
                408, f"the {what} did not arrive within {clock.timeout:g} s",
                code="request_timeout")))
        self._guard.closed(clock.reason)
        transport = self.transport
        self.force_close()  # the route still reading the body is cancelled with it
        abort_later(transport, self._loop)

    def _process_keepalive(self) -> None:
        if self._head_clock is not None:  # a head is arriving: its own clock rules
            self._keepalive_handle = None
            return
        was_open = not self._force_close
        super()._process_keepalive()
        if was_open and self._force_close:
            self._guard.closed("idle")

    async def _handle_request(self, request, start_time, request_handler):
        self._last_request = request
        try:
            resp, reset = await super()._handle_request(request, start_time,
                                                        request_handler)
            if _is_holding_its_body(request):
                # answered without a 100: the client will not send its body, so aiohttp's
                # lingering (reading the rest of a refused body) would only wait
                self._lingering_time = 0.0
            return resp, reset
        finally:
            self._restart_clocks_after(request)

    def _restart_clocks_after(self, request: web.BaseRequest) -> None:
        """Clocks of later requests count from the end of ``request``."""
        now = self._loop.time()
        for clock in (self._head_clock, self._body_clock):
            if clock is None or clock.payload is request.content or self.transport is None:
                continue
            clock.started = max(clock.started, now)
            if clock.handle is None:
                clock.handle = self._loop.call_at(clock.started + clock.timeout,
                                                  self._on_clock, clock)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        log.warning("protocol error, http request refused", status=status,
                    error=type(exc).__name__ if exc is not None else None)
        if request.writer.output_size > 0:  # a response has begun: only closing is left
            raise ConnectionError("response already started")
        err = error_for(status, exc)
        resp = web.json_response(err.body(), status=err.status)
        resp.force_close()
        return resp
