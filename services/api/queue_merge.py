"""Reading several engine queues as one: the sub-requests of a batched completion.

    queue 0 ──forward──┐
    queue 1 ──forward──┼──▶ merged: (k, item) in arrival order
    queue k ──forward──┘

Each forwarder copies its queue's items, tagged with the queue's position, into one
queue; closing the :class:`MergedQueues` cancels the forwarders that still wait.
"""
from __future__ import annotations

import asyncio
from typing import Any


class MergedQueues:
    """``get()`` returns ``(k, item)``: the next item of any of the queues and whose."""

    def __init__(self, queues: list[asyncio.Queue]):
        self._merged: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._forward(k, q))
                       for k, q in enumerate(queues)] if len(queues) > 1 else []
        self._single = queues[0] if len(queues) == 1 else None

    async def _forward(self, k: int, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            self._merged.put_nowait((k, item))
            if item is None:  # the engine link went away: nothing follows
                return

    async def get(self) -> tuple[int, Any]:
        if self._single is not None:  # one prompt: no task, no extra hop
            return 0, await self._single.get()
        return await self._merged.get()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
