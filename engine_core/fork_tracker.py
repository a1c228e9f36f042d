"""The samples of n > 1 requests around their fork: waiting for it, then parked.

The first sample added for a parent is the fork source and is scheduled normally.
Later samples wait (``WAITING_FOR_FORK``: outside the waiting queue, no blocks) until
the source has computed its whole prompt; then each shares the source's K/V for all
prompt tokens but the last, and enters the waiting queue "parked": holding blocks
while not running. If the source ends first, the next waiting sample takes its role,
so no sample is ever stranded.

Parked blocks are the one place where a waiting request owns memory. The scheduler
reclaims them (the sample then recomputes from scratch) before it preempts a running
request or gives up admitting one, so they can never deadlock the pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduler_output import BlockCopy


@dataclass(slots=True)
class ForkGroup:
    """The source sample of one parent and the samples waiting to fork from it."""

    source: Request
    waiters: list[Request] = field(default_factory=list)


class ForkTracker:
    """Fork groups by parent id, parked samples, and block copies not yet sent."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._groups: dict[str, ForkGroup] = {}
        self._parked: dict[str, Request] = {}  # in park order
        self._pending_copies: dict[str, BlockCopy] = {}  # keyed by the copy's owner

    @property
    def num_waiters(self) -> int:
        return sum(len(g.waiters) for g in self._groups.values())

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def add(self, request: Request) -> bool:
        """Register a new request; True if it must wait for a fork (status set).

        A sample joins its parent's group only while the source's prompt is unfinished.
        """
        if request.parent_req_id is None:
            return False
        group = self._groups.get(request.parent_req_id)
        if group is None:
            self._groups[request.parent_req_id] = ForkGroup(request)
            return False
        if group.source.num_computed_tokens >= group.source.num_prompt_tokens:
            return False
        request.status = RequestStatus.WAITING_FOR_FORK
        group.waiters.append(request)
        return True

    def fork_ready(self, source: Request) -> list[Request]:
        """Fork every sample waiting on ``source`` if its prompt is computed.

        Returns the forked samples (status WAITING, in index order) for the caller to
        put at the front of the waiting queue. The group is closed afterwards.
        """
        group = self._groups.get(source.parent_req_id) if source.parent_req_id else None
        if (group is None or group.source is not source
                or source.num_computed_tokens < source.num_prompt_tokens):
            return []
        del self._groups[source.parent_req_id]
        # Each sample recomputes the last prompt token itself to sample its own token.
        num_shared = source.num_prompt_tokens - 1
        for child in group.waiters:
            result = self.kv_cache_manager.fork(source, child, num_shared)
            child.num_computed_tokens = result.num_computed_tokens
            child.status = RequestStatus.WAITING
            if self.kv_cache_manager.num_blocks_of(child.req_id):
                self._parked[child.req_id] = child
            if result.block_copy is not None:
                self._pending_copies[child.req_id] = result.block_copy
        return group.waiters

    def unpark(self, request: Request) -> None:
        """The request was admitted: its blocks are a running request's now."""
        self._parked.pop(request.req_id, None)

    def reclaim(self, keep: Request | None = None) -> bool:
        """Free the blocks of the latest parked sample other than ``keep``."""
        for request in reversed(list(self._parked.values())):
            if request is not keep:
                self._release(request)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                return True
        return False

    def take_block_copies(self) -> list[BlockCopy]:
        """Copies owed since the last call; the runner must run them this step."""
        copies = list(self._pending_copies.values())
        self._pending_copies.clear()
        return copies

    def _release(self, request: Request) -> None:
        self._parked.pop(request.req_id, None)
        self._pending_copies.pop(request.req_id, None)

    def remove(self, request: Request) -> Request | None:
        """Forget a request that ended; returns a waiter promoted to source, if any.

        The caller frees the request's blocks and queues the promoted sample.
        """
        self._release(request)
        group = self._groups.get(request.parent_req_id) if request.parent_req_id else None
        if group is None:
            return None
        if group.source is not request:
            if request in group.waiters:
                group.waiters.remove(request)
            return None
        if not group.waiters:
            del self._groups[request.parent_req_id]
            return None
        promoted = group.waiters.pop(0)
        promoted.status = RequestStatus.WAITING
        if group.waiters:
            group.source = promoted
        else:
            del self._groups[request.parent_req_id]
        return promoted
