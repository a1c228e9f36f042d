"""The engine core's side of its API processes: who is connected, sending to them
without letting one that went away break the step loop, and telling all of them when
the queue fills or drains (backpressure, see engine_core/queue_limits.py) and, for a
data-parallel replica, what its prefix cache holds (engine_core/kv_events.py)."""
from __future__ import annotations

from engine_core.engine import EngineCore
from engine_core.kv_events import KVCacheEvents, KVEventLog
from observability.logging import get_logger
from services.protocol import QueueState
from services.transport import PeerLink

log = get_logger("services.engine_core")


async def send_to_client(link: PeerLink, message) -> None:
    """Send to an API process; one that has gone away loses the message, not the loop
    (its handler then aborts the requests it owned)."""
    if link.closed:
        return
    try:
        await link.send(message)
    except (ConnectionError, RuntimeError) as e:
        log.warning("cannot send to an API process", peer=link.name, error=str(e))


class APIClients:
    """The connected API processes and what they were told about the queue.

    Invariant: after ``publish`` returns, every client holds the current ``is_full``.
    ``is_full`` changes before the frames go out, so a client that joins mid-publish
    reads the new value; ``announced_full`` changes after, so a probe that sees it
    knows that every client was told.

    With ``publish_cache`` (parallel.data_parallel_size > 1) every client also learns
    the block hashes the prefix cache holds: all of them when it joins, then each
    step's changes; a joiner may get a change twice (in its snapshot and in the next
    batch), which the log's latest-state batches make harmless.
    """

    def __init__(self, engine: EngineCore, publish_cache: bool = False):
        self.engine = engine
        self.links: set[PeerLink] = set()
        self.is_full = False
        self.announced_full = False
        self.kv_events: KVEventLog | None = None
        if publish_cache:
            self.kv_events = engine.scheduler.kv_cache_manager.block_pool.events = KVEventLog()

    def _state(self) -> QueueState:
        stats = self.engine.get_stats()
        return QueueState(self.is_full, stats.num_waiting, stats.num_waiting_tokens)

    async def join(self, link: PeerLink) -> None:
        """Add a client (after its WorkerReady) and tell it the queue's state."""
        self.links.add(link)  # first: a flip published from now on reaches it
        await send_to_client(link, self._state())
        if self.kv_events is not None:
            pool = self.engine.scheduler.kv_cache_manager.block_pool
            await send_to_client(link, KVCacheEvents(list(pool.cached_blocks),
                                                     is_cleared=True))

    def leave(self, link: PeerLink) -> None:
        self.links.discard(link)

    async def publish(self) -> None:
        """After a step: one QueueState to every client if ``is_full`` flipped, and the
        prefix cache's changes when they are published."""
        if self.kv_events is not None and (events := self.kv_events.drain()):
            for link in list(self.links):
                await send_to_client(link, events)
        full = self.engine.is_queue_full()
        if full == self.is_full:
            return
        self.is_full = full
        state = self._state()
        for link in list(self.links):
            await send_to_client(link, state)
        self.announced_full = full
