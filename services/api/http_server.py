"""The API's HTTP server: aiohttp with the YAML's limits, deadlines and connection cap.

Every accepted connection is served by an :class:`APIRequestHandler`
(connection_handler.py: header, body and idle deadlines, the Transfer-Encoding check,
errors in OpenAI's JSON shape), or, past ``api.max_connections`` open ones, answered
503 and closed by the app's :class:`ConnectionGuard` (connection_guard.py), which
also counts what it closes for /metrics.
"""
from __future__ import annotations

import socket

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from config.schema import APIConfig
from services.api.connection_guard import CONNECTION_GUARD, ConnectionGuard
from services.api.connection_handler import APIRequestHandler
from services.transport import Endpoint, start_sites


def handler_args(api: APIConfig) -> dict:
    """aiohttp connection-handler limits from the YAML's ``api`` section."""
    return {"max_line_size": api.max_header_bytes, "max_field_size": api.max_header_bytes,
            "max_headers": api.max_headers, "keepalive_timeout": api.keepalive_timeout_s}


class _GuardedServer(web.Server):
    guard: ConnectionGuard

    def __call__(self) -> RequestHandler:  # the protocol factory: one call per connection
        if not self.guard.has_room():
            return self.guard.refusal()
        return APIRequestHandler(self, guard=self.guard, loop=self._loop, **self._kwargs)


class APIRunner(web.AppRunner):
    """An AppRunner whose connections pass through ``guard``."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs):
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer  # same state, one overridden factory method
        server.guard = self.guard
        return server


async def serve_api(app: web.Application, api: APIConfig, endpoints: list[Endpoint],
                    sockets: list[socket.socket] = (), shutdown_timeout: float = 1.0,
                    reuse_port: bool = False) -> web.AppRunner:
    """Serve the API app on TCP/unix ``endpoints`` and listening ``sockets``.

    Connections are guarded by the app's ConnectionGuard (one is made if it has none).
    Handlers are cancelled when their client disconnects, so a queued request is
    aborted at once.
    """
    guard = app.get(CONNECTION_GUARD) or ConnectionGuard(api)
    guard.warn_if_over_fd_limit()
    runner = APIRunner(app, guard, access_log=None, shutdown_timeout=shutdown_timeout,
                       handler_cancellation=True, **handler_args(api))
    return await start_sites(runner, endpoints, sockets, reuse_port)
