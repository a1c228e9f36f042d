"""Which data-parallel replica serves a request (``parallel.routing``).

    prefix_aware  the replica that holds the longest run of the prompt's leading
                  block hashes wins; ties go to the one with fewer requests in flight,
                  then to the one holding fewer blocks, then to the lower index. When the winner has more than
                  ``routing_max_imbalance`` requests in flight beyond the least loaded
                  replica, the least loaded one gets the request instead.
    round_robin   replicas in turn.
    least_loaded  the replica with fewest requests in flight (then fewer blocks held,
                  then the lower index).

What a replica "holds" is what its engine core reported caching (KVCacheEvents,
engine_core/kv_events.py) plus the blocks of the requests this process sent it that
are still running: a prefix is routed to the replica computing it before its blocks
are even stored, so a burst of requests sharing a prefix lands in one place. The hashes
are computed here with the engine core's own function, digest and block size
(engine_core/block_hash.py). A request naming a LoRA adapter cannot be hashed here (the
engine core numbers adapters), so it goes to the least loaded replica.

Load is this API process's own count of requests in flight per replica (each API
process routes alone; the engine cores' queues are the shared truth). Dead replicas
are never chosen; the caller passes which are alive.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_core.block_hash import BlockHash, HashFn, prompt_block_hashes
from engine_core.kv_events import KVCacheEvents


@dataclass(slots=True)
class ReplicaCache:
    """One replica's cached block hashes (from its events) and this process's requests
    in flight there, with the hashes of their prompts."""

    cached: set[BlockHash] = field(default_factory=set)
    pending: Counter = field(default_factory=Counter)  # hash → requests in flight with it
    num_in_flight: int = 0

    def apply(self, events: KVCacheEvents) -> None:
        if events.is_cleared:
            self.cached.clear()
        self.cached.update(events.stored)
        self.cached.difference_update(events.removed)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self.cached or block_hash in self.pending

    def num_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``' leading blocks this replica holds."""
        n = 0
        for block_hash in hashes:  # a chain: the first miss ends the match
            if not self.holds(block_hash):
                break
            n += 1
        return n


@dataclass(slots=True)
class Route:
    """Where one request went and why (kept until the request is forgotten)."""

    replica: int
    hashes: list[BlockHash]
    num_prefix_blocks: int = 0


class ReplicaRouter:
    """Picks a replica for each request and tracks this process's load on each."""

    def __init__(self, num_replicas: int, policy: str, max_imbalance: int,
                 block_size: int, hash_fn: HashFn, enable_caching: bool = True):
        self.policy = policy
        self.max_imbalance = max_imbalance
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.enable_caching = enable_caching
        self.replicas = [ReplicaCache() for _ in range(num_replicas)]
        self._turn = itertools.count()
        self.num_imbalance_overrides = 0  # prefix_aware picks overruled by load

    def on_cache_events(self, replica: int, events: KVCacheEvents) -> None:
        self.replicas[replica].apply(events)

    def on_replica_lost(self, replica: int) -> None:
        """A dead replica's cache is gone with it (it is never chosen again)."""
        self.replicas[replica].cached.clear()

    def route(self, prompt_token_ids: Sequence[int], alive: Sequence[int],
              cache_salt: str | None = None, lora_name: str | None = None) -> Route:
        """The replica for a request among ``alive`` (indices; at least one), counted
        in flight there until ``finish``."""
        if not alive:
            raise ValueError("no replica is alive")
        hashes: list[BlockHash] = []
        if self.policy == "prefix_aware" and self.enable_caching and lora_name is None:
            hashes = prompt_block_hashes(prompt_token_ids, self.block_size, self.hash_fn,
                                         0, cache_salt)
        if self.policy == "round_robin":
            route = Route(alive[next(self._turn) % len(alive)], hashes)
        elif self.policy == "least_loaded" or not hashes:
            route = Route(self._least_loaded(alive), hashes)
        else:
            route = self._by_prefix(hashes, alive)
        cache = self.replicas[route.replica]
        cache.num_in_flight += 1
        cache.pending.update(route.hashes)
        return route

    def finish(self, route: Route) -> None:
        """The request ended: no longer in flight (its blocks are in the replica's
        events by now, if the replica kept them)."""
        cache = self.replicas[route.replica]
        cache.num_in_flight -= 1
        cache.pending.subtract(route.hashes)
        for block_hash in route.hashes:
            if cache.pending[block_hash] <= 0:
                del cache.pending[block_hash]

    def _load(self, replica: int) -> tuple[int, int, int]:
        """Requests in flight, then blocks held (a new prefix goes where fewer are
        cached, so distinct prefixes spread even when requests come one at a time),
        then the index."""
        cache = self.replicas[replica]
        return cache.num_in_flight, len(cache.cached) + len(cache.pending), replica

    def _least_loaded(self, alive: Sequence[int]) -> int:
        return min(alive, key=self._load)

    def _by_prefix(self, hashes: list[BlockHash], alive: Sequence[int]) -> Route:
        matches = {r: self.replicas[r].num_prefix_blocks(hashes) for r in alive}
        best = min(alive, key=lambda r: (-matches[r], *self._load(r)))
        least = self._least_loaded(alive)
        load = self.replicas[best].num_in_flight - self.replicas[least].num_in_flight
        if load > self.max_imbalance:
            self.num_imbalance_overrides += 1
            best = least
        return Route(best, hashes, matches[best])

    def loads(self) -> list[int]:
        """Requests in flight from this process, per replica."""
        return [cache.num_in_flight for cache in self.replicas]
