"""The error mapper: whatever a route raises becomes one OpenAI-shaped JSON answer.

    APIError           its own status, body and headers
    HTTPException      aiohttp's own (404 route, 405 method) in OpenAI's shape
    EngineDead         503 engine_unavailable
    QueueFull          503 queue_full with Retry-After
    anything else      a bug: a bare 500, logged with the route, never a traceback,
                       a path or the input; if a stream has begun, the connection drops

An answer given before the request's body arrived in full (a 413, a 401 or 503 before
reading, any refusal of ``Expect: 100-continue``) also closes the connection: the
refused body is never read, so the connection cannot carry another request.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from observability.logging import get_logger
from services.api.engine_client import EngineDead, QueueFull
from services.api.openai_protocol import APIError, unavailable

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
log = get_logger("services.api")


def error_response(request: web.BaseRequest, exc: BaseException) -> web.Response | None:
    """The JSON answer for a known error (see the module docstring); None for a bug."""
    if isinstance(exc, APIError):
        resp = web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    elif isinstance(exc, web.HTTPException):
        err = APIError(exc.status, exc.reason or "error", type="invalid_request_error")
        resp = web.json_response(err.body(), status=exc.status)
    elif isinstance(exc, EngineDead):
        resp = web.json_response(unavailable(str(exc)).body(), status=503)
    elif isinstance(exc, QueueFull):
        resp = web.json_response(unavailable(str(exc), "queue_full").body(), status=503,
                                 headers={"Retry-After": str(RETRY_AFTER_S)})
    else:
        return None
    if resp.status == 413 or not request.content.is_eof():
        resp.force_close()  # the refused body is never read: end the connection
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Map exceptions to JSON errors (see the module docstring)."""
    try:
        return await handler(request)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        resp = error_response(request, e)
        if resp is not None:
            return resp
        # a bug: no traceback, path or input goes to the client
        resource = request.match_info.route.resource
        log.error("unhandled error", error=type(e).__name__,
                  route=resource.canonical if resource is not None else None)
        if request.writer is not None and request.writer.output_size > 0:
            raise  # a stream has begun: only dropping the connection is left
        err = APIError(500, "internal server error", "server_error")
        return web.json_response(err.body(), status=500)
