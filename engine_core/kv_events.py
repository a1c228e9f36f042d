"""The prefix cache's change log: which block hashes became findable and which were
forgotten, drained after each step and sent to the API processes, which route requests
to the replica caching most of their prefix (services/api/replica_router.py).

The log keeps only each hash's latest state since the last drain, so a batch holds a
hash at most once and the reader may apply ``stored`` and ``removed`` in any order:

    stored h, evicted h, stored h again   →   stored [h]
    stored h, evicted h                   →   removed [h]  (harmless if never seen)

A reset of the whole cache drops what the log held and marks the batch ``is_cleared``:
the reader forgets everything first, then applies the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.block_hash import BlockHash


@dataclass(slots=True)
class KVCacheEvents:
    """One drained batch: hashes now cached, hashes no longer cached, and whether the
    whole cache was forgotten before them."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    is_cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.is_cleared)


class KVEventLog:
    """Collects the block pool's changes between drains (see the module docstring)."""

    def __init__(self):
        self._changes: dict[BlockHash, bool] = {}  # hash → cached now?
        self._is_cleared = False

    def on_stored(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = True

    def on_removed(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = False

    def on_cleared(self) -> None:
        self._changes.clear()
        self._is_cleared = True

    def drain(self) -> KVCacheEvents:
        """The changes since the last drain (empty, and falsy, when there were none)."""
        events = KVCacheEvents([h for h, cached in self._changes.items() if cached],
                               [h for h, cached in self._changes.items() if not cached],
                               self._is_cleared)
        self._changes.clear()
        self._is_cleared = False
        return events
