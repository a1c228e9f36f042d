"""The error mapper: whatever a route raises becomes one OpenAI-shaped JSON answer.

    APIError           its own status and body (413 also closes the connection: the
                       refused body was never read)
    HTTPException      aiohttp's own (404 route, 405 method) in OpenAI's shape
    EngineDead         503 engine_unavailable
    QueueFull          503 queue_full with Retry-After
    anything else      a bug: a bare 500, logged with the route, never a traceback,
                       a path or the input; if a stream has begun, the connection drops
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from observability.logging import get_logger
from services.api.engine_client import EngineDead, QueueFull
from services.api.openai_protocol import APIError, unavailable

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
log = get_logger("services.api")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Map exceptions to JSON errors (see the module docstring)."""
    try:
        return await handler(request)
    except APIError as e:
        resp = web.json_response(e.body(), status=e.status)
        if e.status == 413:  # the refused body is never read: end the connection
            resp.force_close()
        return resp
    except web.HTTPException as e:
        err = APIError(e.status, e.reason or "error", type="invalid_request_error")
        return web.json_response(err.body(), status=e.status)
    except EngineDead as e:
        return web.json_response(unavailable(str(e)).body(), status=503)
    except QueueFull as e:
        return web.json_response(unavailable(str(e), "queue_full").body(), status=503,
                                 headers={"Retry-After": str(RETRY_AFTER_S)})
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:  # a bug: no traceback, path or input goes to the client
        resource = request.match_info.route.resource
        log.error("unhandled error", error=type(e).__name__,
                  route=resource.canonical if resource is not None else None)
        if request.writer is not None and request.writer.output_size > 0:
            raise  # a stream has begun: only dropping the connection is left
        err = APIError(500, "internal server error", "server_error")
        return web.json_response(err.body(), status=500)
