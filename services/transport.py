"""WebSocket links between services: aiohttp on unix sockets (or TCP for containers).

One persistent WebSocket per peer carries binary msgpack frames (services/protocol.py);
a round trip over a unix socket costs ~33 us against ~250 us for an HTTP POST, so every
per-step message rides it. A peer that sends a frame that does not decode (garbage,
a pickle, a frame over MAX_FRAME_BYTES, a text frame) is logged as a protocol error
and disconnected, and so is a connection that does not even speak HTTP; the service
itself keeps running. Nothing here or in services/protocol.py ever unpickles.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from observability.logging import get_logger
from services.protocol import ProtocolError, decode, encode

log = get_logger(__name__)

WS_PATH = "/ws"
# Largest frame a peer may send; aiohttp refuses a bigger one from its header, before
# buffering the payload. The biggest real frame, an ExecuteStep admitting max_num_seqs
# new prompts of max_model_len tokens (128 x 2048 ids: ~2.6 MB), fits many times over.
MAX_FRAME_BYTES = 64 * 1024 * 1024


@dataclass(slots=True, frozen=True)
class Endpoint:
    """Where a service listens: a unix socket path, or host and port."""

    unix_path: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, address: str) -> "Endpoint":
        """``host:port`` → a TCP endpoint (the config has checked the shape)."""
        host, _, port = address.rpartition(":")
        return cls(host=host, port=int(port))

    def __str__(self) -> str:
        return self.unix_path if self.unix_path is not None else f"{self.host}:{self.port}"

    def url(self, path: str = WS_PATH) -> str:
        if self.unix_path is not None:
            return f"http://localhost{path}"  # the host is ignored over a unix socket
        return f"http://{self.host}:{self.port}{path}"

    def connector(self) -> aiohttp.BaseConnector:
        if self.unix_path is not None:
            return aiohttp.UnixConnector(path=self.unix_path)
        return aiohttp.TCPConnector()


class PeerLink:
    """One side of a WebSocket: send messages, iterate over received ones."""

    def __init__(self, ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                 name: str):
        self.ws = ws
        self.name = name

    async def send(self, message: Any) -> None:
        await self.ws.send_bytes(encode(message))

    async def send_frame(self, frame: bytes) -> None:
        """Send a frame ``encode`` already made (a caller that checked its size)."""
        await self.ws.send_bytes(frame)

    async def messages(self):
        """Decoded messages until the peer closes; a bad frame closes the link."""
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                try:
                    yield decode(msg.data)
                except ProtocolError as e:
                    log.warning("protocol error, disconnecting peer", peer=self.name,
                                error=str(e))
                    await self.ws.close(code=aiohttp.WSCloseCode.UNSUPPORTED_DATA,
                                        message=b"protocol error")
                    return
            elif msg.type in (aiohttp.WSMsgType.TEXT,):
                log.warning("text frame from peer, disconnecting", peer=self.name)
                await self.ws.close(code=aiohttp.WSCloseCode.UNSUPPORTED_DATA,
                                    message=b"binary frames only")
                return
            elif msg.type == aiohttp.WSMsgType.ERROR:  # e.g. a frame over MAX_FRAME_BYTES
                log.warning("protocol error, disconnecting peer", peer=self.name,
                            error=str(self.ws.exception()))
                return

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def close(self) -> None:
        await self.ws.close()


PeerHandler = Callable[[PeerLink], Awaitable[None]]


class _ConnectionLog(logging.LoggerAdapter):
    """aiohttp's per-connection logger. A request aiohttp cannot parse (random bytes,
    not HTTP) becomes one "protocol error" warning instead of a traceback (or, for a
    bad first line, nothing at all: aiohttp logs that at debug level)."""

    def log(self, level, msg, *args, exc_info=None, **kwargs):
        if isinstance(exc_info, HttpProcessingError):  # a handler's own error is not
            first_line = str(exc_info.message).splitlines()[0] if exc_info.message else ""
            log.warning("protocol error, refusing request",
                        error=f"{type(exc_info).__name__}: {first_line[:80]}")
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


_CONNECTION_LOG = _ConnectionLog(logging.getLogger("aiohttp.server"), {})


def websocket_route(handler: PeerHandler, name: str) -> Callable:
    """An aiohttp handler that upgrades to a WebSocket and hands it to ``handler``."""

    async def route(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=MAX_FRAME_BYTES, heartbeat=None)
        await ws.prepare(request)
        link = PeerLink(ws, name)
        try:
            await handler(link)
        finally:
            await ws.close()
        return ws

    return route


async def start_site(app: web.Application, endpoint: Endpoint,
                     shutdown_timeout: float = 2.0) -> web.AppRunner:
    """Serve ``app`` on ``endpoint``; a unix socket is created with mode 0600.

    ``shutdown_timeout`` bounds how long cleanup waits for open handlers (a peer's
    WebSocket stays open for the life of the link)."""
    return await serve_app(app, [endpoint], shutdown_timeout=shutdown_timeout)


async def serve_app(app: web.Application, endpoints: list[Endpoint],
                    sockets: list[socket.socket] = (), shutdown_timeout: float = 2.0,
                    reuse_port: bool = False,
                    handler_cancellation: bool = False) -> web.AppRunner:
    """Serve ``app`` on every endpoint and on already-listening ``sockets`` at once.

    ``handler_cancellation`` cancels a handler when its client disconnects (the API
    uses it so a request that waits in the queue is aborted at once)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout,
                           handler_cancellation=handler_cancellation, logger=_CONNECTION_LOG)
    return await start_sites(runner, endpoints, sockets, reuse_port)


async def start_sites(runner: web.AppRunner, endpoints: list[Endpoint],
                      sockets: list[socket.socket] = (),
                      reuse_port: bool = False) -> web.AppRunner:
    """Set ``runner`` up and listen on every endpoint and socket; cleans up on failure."""
    await runner.setup()
    try:
        for endpoint in endpoints:
            if endpoint.unix_path is not None:
                await _start_unix_site(runner, Path(endpoint.unix_path))
            else:
                await web.TCPSite(runner, endpoint.host, endpoint.port,
                                  reuse_port=reuse_port or None).start()
        for sock in sockets:
            await web.SockSite(runner, sock).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def _start_unix_site(runner: web.AppRunner, path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_socket():
        path.unlink()  # a stale socket from a previous run
    old_umask = os.umask(0o177)  # the socket is born 0600: no window for others
    try:
        await web.UnixSite(runner, str(path)).start()
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)


async def connect(endpoint: Endpoint, name: str, timeout: float = 30.0,
                  retry_interval: float = 0.05) -> tuple[PeerLink, aiohttp.ClientSession]:
    """Open the WebSocket to ``endpoint``, retrying until it listens or ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        session = aiohttp.ClientSession(connector=endpoint.connector())
        try:
            ws = await session.ws_connect(endpoint.url(), max_msg_size=MAX_FRAME_BYTES,
                                          autoping=True, heartbeat=None)
            return PeerLink(ws, name), session
        except (aiohttp.ClientConnectionError, FileNotFoundError, OSError):
            await session.close()
            if loop.time() >= deadline:
                raise ConnectionError(f"{name}: nothing listening at {endpoint} after "
                                      f"{timeout:.0f}s") from None
            await asyncio.sleep(retry_interval)


async def probe_health(endpoint: Endpoint, timeout: float = 5.0) -> tuple[int, dict]:
    """GET ``/health`` on ``endpoint``: (HTTP status, JSON body or {}); (0, {}) if unreachable."""
    try:
        async with aiohttp.ClientSession(connector=endpoint.connector(),
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.get(endpoint.url("/health")) as resp:
                try:
                    body = await resp.json(content_type=None)
                except ValueError:
                    body = {}
                return resp.status, body if isinstance(body, dict) else {}
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return 0, {}
