"""Admission: whether this API process takes a new generation request now.

A generation request (a POST under ``/v1/``) is refused before its body is read or
tokenized while the process drains (503 shutting_down) or while the engine core last
said its queue is full (503 queue_full) or that the model sleeps (503 sleeping, see
control_routes.py); the engine core re-checks every add, this is only the cheap early
answer. The same check answers ``Expect: 100-continue``.

A request counts in flight only from the moment its body has been read and checked
(``admitted``), so a drain waits for the generations it promised, never for a client
that trickles a body (the body timeout ends those). Authentication runs before this
(services/api/auth.py): a caller without a key learns nothing, not even that the
server is busy.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from aiohttp import web

from services.api.engine_client import QueueFull
from services.api.openai_protocol import unavailable


def is_generation(request: web.Request) -> bool:
    """Completions and chat completions: the requests that reach the engine."""
    return request.method == "POST" and request.path.startswith("/v1/")


class Admission:
    """Draining flag, in-flight count and the queue-full check of one API process."""

    def __init__(self, engine):
        self.engine = engine  # EngineClient: its queue_state is the engine core's last word
        self.num_in_flight = 0  # generation requests being served now
        self.draining = False  # set on SIGTERM: finish what runs, refuse new work
        self._idle = asyncio.Event()
        self._idle.set()

    def begin_drain(self) -> None:
        """Refuse new generation requests (503); those in flight carry on."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def check(self) -> None:
        """Raise the 503 a new generation request gets now, if any."""
        if self.draining:
            raise unavailable("the server is shutting down", "shutting_down")
        health = self.engine.fresh_health()
        if health is not None and health.detail.get("is_sleeping"):
            raise unavailable("the model is asleep (POST /wake_up wakes it)", "sleeping")
        queue = self.engine.queue_state
        if queue.is_full:
            raise QueueFull(f"the server is at capacity ({queue.num_waiting} requests "
                            f"queued); retry later")

    def check_request(self, request: web.BaseRequest) -> None:
        """``check`` for a generation request; nothing for the other routes."""
        if is_generation(request):
            self.check()

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Count one generation request (its body read) in flight while it runs; the
        503 first if the drain began or the queue filled while the body was read."""
        self.check()
        self.num_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """The early 503, before the body is read (see the module docstring)."""
        self.check_request(request)
        return await handler(request)
