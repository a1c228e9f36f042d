"""Admission: whether this API process takes a new generation request now.

A generation request (a POST under ``/v1/``) is refused before its body is read or
tokenized while the process drains (503 shutting_down) or while the engine core last
said its queue is full (503 queue_full; the engine core re-checks every add, this is
only the cheap early answer). Admitted requests are counted in flight, so a drain can
wait for them to finish. Authentication runs before this (services/api/auth.py): a
caller without a key learns nothing, not even that the server is busy.
"""
from __future__ import annotations

import asyncio

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
        queue = self.engine.queue_state
        if queue.is_full:
            raise QueueFull(f"the server is at capacity ({queue.num_waiting} requests "
                            f"queued); retry later")

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if not is_generation(request):
            return await handler(request)
        self.check()
        self.num_in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()
