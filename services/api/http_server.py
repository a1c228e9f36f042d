"""The API's HTTP server: aiohttp with the YAML's size limits, and errors in OpenAI's shape.

aiohttp's parser enforces the header limits (``max_header_bytes`` per request line or
field, ``max_headers`` fields) and refuses malformed framing (a negative, non-numeric,
overflowing or duplicated Content-Length) before any route runs. Those errors never
reach a middleware, so the connection handler below answers them itself: 431 for
header limits, 400 for the rest, 500 for anything a handler let escape, all as
``{"error": {...}}`` with a fixed message. It never echoes the offending bytes, logs
only the error's type (a too-long header may hold a credential), and never shows a
traceback whatever aiohttp's debug setting.
"""
from __future__ import annotations

import socket
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from config.schema import APIConfig
from observability.logging import get_logger
from services.api.openai_protocol import APIError
from services.transport import Endpoint, start_sites

log = get_logger(__name__)


def handler_args(api: APIConfig) -> dict:
    """aiohttp connection-handler limits from the YAML's ``api`` section."""
    return {"max_line_size": api.max_header_bytes, "max_field_size": api.max_header_bytes,
            "max_headers": api.max_headers}


def _is_header_limit(exc: BaseException | None) -> bool:
    # aiohttp reports a request line or header field over the limit as LineTooLong and
    # too many fields as a BadHttpMessage with this message (tests pin both).
    return isinstance(exc, LineTooLong) or (
        isinstance(exc, BadHttpMessage) and "too many headers" in exc.message.lower())


def error_for(status: int, exc: BaseException | None) -> APIError:
    """The OpenAI-shaped error for a request aiohttp could not hand to the app."""
    if _is_header_limit(exc):
        return APIError(431, "the request line or header fields are too large or too many",
                        code="request_header_fields_too_large")
    if status >= 500:
        return APIError(status, "internal server error", "server_error")
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = str(status)
    return APIError(status, f"malformed HTTP request ({phrase})")


class JSONErrorRequestHandler(RequestHandler):
    """aiohttp's per-connection handler, answering its own errors as OpenAI JSON."""

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


class _JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JSONErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class APIRunner(web.AppRunner):
    """An AppRunner whose connections use :class:`JSONErrorRequestHandler`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JSONErrorServer  # same state, one overridden factory method
        return server


async def serve_api(app: web.Application, api: APIConfig, endpoints: list[Endpoint],
                    sockets: list[socket.socket] = (), shutdown_timeout: float = 1.0,
                    reuse_port: bool = False) -> web.AppRunner:
    """Serve the API app on TCP/unix ``endpoints`` and listening ``sockets``.

    Handlers are cancelled when their client disconnects, so a queued request is
    aborted at once.
    """
    runner = APIRunner(app, access_log=None, shutdown_timeout=shutdown_timeout,
                       handler_cancellation=True, **handler_args(api))
    return await start_sites(runner, endpoints, sockets, reuse_port)
