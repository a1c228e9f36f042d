"""The engine core's health: the progress watchdog, its gauges, and the snapshots it
pushes to every API process.

A /health probe never reaches the engine core. Each API process answers it from the
latest HealthSnapshot; a publisher task here wakes every HEALTH_PUBLISH_INTERVAL_S,
computes the gauges (counters only, never a scan of the KV blocks) and sends them to
every client when they changed, or as a heartbeat every HEALTH_HEARTBEAT_S so that a
silent engine core shows as a stale snapshot. The task runs beside the step loop, so
a step the worker never answers turns ``ok`` false after ``services.step_timeout_s``.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import web

from services.engine_core_service.api_clients import send_to_client
from services.protocol import (HEALTH_HEARTBEAT_S, HEALTH_PUBLISH_INTERVAL_S,
                               HealthSnapshot)
from services.transport import PeerLink

if TYPE_CHECKING:
    from services.engine_core_service.service import EngineCoreService

# Moves on its own while busy; a change of it alone is not news worth a frame.
_CLOCK_GAUGE = "seconds_since_last_step"


class EngineHealth:
    """Progress and gauges of one EngineCoreService, read from its public state."""

    def __init__(self, service: EngineCoreService):
        self.service = service
        self.num_steps = 0
        self.last_step_time = time.monotonic()
        self._sent: HealthSnapshot | None = None
        self._sent_at = 0.0

    def on_step(self) -> None:
        self.num_steps += 1
        self.last_step_time = time.monotonic()

    def on_wake(self) -> None:
        """The loop woke from idle: time spent idle is not a stall."""
        self.last_step_time = time.monotonic()

    def seconds_stalled(self) -> float:
        """How long the loop has made no step while there is work (0 when idle)."""
        s = self.service
        busy = s.engine.has_unfinished_requests() or bool(s.inbox)
        return time.monotonic() - self.last_step_time if busy else 0.0

    def is_healthy(self) -> bool:
        """Alive and making progress: a live process whose steps stalled is not healthy."""
        s = self.service
        return (s.engine is not None and s.failure is None
                and self.seconds_stalled() <= s.worker.step_timeout_s)

    def detail(self) -> dict[str, float]:
        """Gauges a probe (or a test) needs to see that the engine is alive and clean:
        after the last request ends, ``num_requests``, ``num_routed_requests`` and
        ``num_referenced_blocks`` (blocks with a reference count above 0) are all 0."""
        s = self.service
        stats = s.engine.get_stats()
        pool = s.engine.scheduler.kv_cache_manager.block_pool
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_waiting_tokens": stats.num_waiting_tokens,
                "is_queue_full": float(s.clients.announced_full),
                "num_requests": s.engine.scheduler.get_num_unfinished_requests(),
                "num_routed_requests": len(s.owner),
                "num_free_blocks": pool.num_free_blocks,
                "num_blocks": pool.num_blocks - 1,  # block 0 is the null block
                "num_referenced_blocks": pool.num_referenced_blocks,
                "kv_cache_usage": stats.kv_cache_usage, "num_steps": self.num_steps,
                "num_split_steps": s.worker.num_split_steps,
                "num_preemptions": stats.num_preemptions, "num_clients": len(s.clients.links),
                # new requests are refused while it sleeps or a sleep waits (RL hooks)
                "is_sleeping": float(s.engine.control.is_sleeping
                                     or s.engine.control.is_sleep_pending),
                "sleep_level": s.engine.control.level,
                "num_prefix_cache_resets": s.engine.control.num_prefix_resets,
                # the running limits (they change with a live retune)
                "max_num_seqs": s.engine.scheduler.config.max_num_seqs,
                "max_num_batched_tokens": s.engine.scheduler.config.max_num_batched_tokens,
                _CLOCK_GAUGE: self.seconds_stalled()}

    def snapshot(self) -> HealthSnapshot:
        ok = self.is_healthy()
        return HealthSnapshot(ok, self.detail() if self.service.engine is not None else {})

    async def send_to(self, link: PeerLink) -> None:
        """A client that just joined gets the current snapshot at once."""
        await send_to_client(link, self.snapshot())

    async def publish(self, force: bool = False) -> None:
        """Send the snapshot to every client if it changed or a heartbeat is due."""
        snapshot, now = self.snapshot(), time.monotonic()
        if not force and now - self._sent_at < HEALTH_HEARTBEAT_S and _same(snapshot,
                                                                             self._sent):
            return
        self._sent, self._sent_at = snapshot, now
        for link in list(self.service.clients.links):
            await send_to_client(link, snapshot)

    async def publish_forever(self) -> None:
        """The publisher task (cancelled when the step loop ends)."""
        while True:
            await self.publish()
            await asyncio.sleep(HEALTH_PUBLISH_INTERVAL_S)

    async def http_health(self, request: web.Request) -> web.Response:
        """The engine core's own /health (the launcher's and healthcheck's probe)."""
        snapshot = self.snapshot()
        body = {"status": "ok" if snapshot.ok else "failed",
                **(snapshot.detail if snapshot.ok else {})}
        return web.json_response(body, status=200 if snapshot.ok else 503)


def _same(a: HealthSnapshot, b: HealthSnapshot | None) -> bool:
    """Equal but for the stall clock."""
    if b is None or a.ok != b.ok or a.detail.keys() != b.detail.keys():
        return False
    return all(a.detail[k] == b.detail[k] for k in a.detail if k != _CLOCK_GAUGE)
