"""The pool of KV-cache blocks: reference counts, the LRU free queue, the hash map.

Every block except the null block 0 is in exactly one of two states:

    owned      ref_cnt > 0, not in the free queue
    free       ref_cnt == 0, in the free queue; if it still has a hash it is
               "cached-free": a later request may revive it with touch()

The free queue is the eviction order: get_new_blocks() takes its head, so the head is
the least recently freed block. Blocks without a hash hold nothing reusable and are
freed to the head (reused first); hashed blocks are freed to the tail. Callers free a
request's blocks tail-first, so a chain's last block is evicted before its first.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from engine_core.block_hash import BlockHash
from engine_core.kv_events import KVEventLog


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One page of K/V for ``block_size`` tokens.

    ``prev_free``/``next_free`` link the block into the free queue; both are None
    exactly when the block is not in it.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    is_null: bool = False
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def is_in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, appendleft and remove.

    Two sentinel nodes bound the list so that every real node has both neighbours.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.is_in_free_queue:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (handed out next)."""
        self._insert_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits."""
        if not block.is_in_free_queue:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block."""
        if self._len == 0:
            raise IndexError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block


class BlockPool:
    """All KV blocks of one cache, with reference counting and prefix-cache lookup."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Blocks with ref_cnt > 0, kept as references come and go so that a health
        # gauge never scans the pool (check_invariants recounts).
        self.num_referenced_blocks = 0
        # Set by a data-parallel engine core: every hash registered or forgotten is
        # logged for the API's prefix-aware routing (kv_events.py).
        self.events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks get_new_blocks() can hand out (cached-free ones included)."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that are owned."""
        usable = self.num_blocks - 1
        return (usable - self.num_free_blocks) / usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the free-queue head, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, "
                             f"{self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.drop_hash(block)
            block.ref_cnt = 1
            out.append(block)
        self.num_referenced_blocks += num_blocks
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, reviving cached-free ones."""
        for block in blocks:
            if block.is_null:
                raise ValueError("the null block cannot be referenced")
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.num_referenced_blocks += 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; pass a chain tail-first (LRU order)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_referenced_blocks -= 1
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash]) -> None:
        """Register ``blocks[i]`` under ``block_hashes[i]`` so later requests can find it.

        A hash already mapped to another block (two requests computed the same prefix
        side by side) keeps its first block; the newcomer stays unregistered.
        """
        if not self.enable_caching:
            return
        if len(blocks) != len(block_hashes):
            raise ValueError("one hash per block is required")
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise ValueError(f"block {block.block_id} already holds another hash")
                continue
            if block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block
                if self.events is not None:
                    self.events.on_stored(block_hash)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under ``block_hash``, owned or cached-free."""
        return self.cached_blocks.get(block_hash)

    def drop_hash(self, block: KVCacheBlock) -> None:
        """Forget a block's content (eviction, or K/V that will never be written)."""
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            if self.events is not None:
                self.events.on_removed(block.block_hash)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is owned."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.on_cleared()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (for tests)."""
        seen: set[int] = set()
        for block in self.free_block_queue:
            _require(not block.is_null, "null block in the free queue")
            _require(block.block_id not in seen, f"block {block.block_id} queued twice")
            _require(block.ref_cnt == 0, f"free block {block.block_id} has "
                     f"ref_cnt {block.ref_cnt}")
            seen.add(block.block_id)
        _require(len(seen) == len(self.free_block_queue), "free queue length is off")
        num_owned = 0
        for block in self.blocks[1:]:
            _require(block.ref_cnt >= 0, f"block {block.block_id} ref_cnt < 0")
            if block.block_id not in seen:
                _require(block.ref_cnt > 0, f"block {block.block_id} neither free nor owned")
                _require(not block.is_in_free_queue, f"block {block.block_id} half-linked")
                num_owned += 1
            if block.block_hash is not None:
                _require(self.cached_blocks.get(block.block_hash) is block,
                         f"block {block.block_id} hash not registered")
        _require(num_owned + len(seen) == self.num_blocks - 1, "free + owned != usable")
        _require(self.num_referenced_blocks == sum(b.ref_cnt > 0 for b in self.blocks),
                 "num_referenced_blocks is off")
        _require(self.null_block.ref_cnt == 0 and not self.null_block.is_in_free_queue,
                 "null block was handed out")
        for block_hash, block in self.cached_blocks.items():
            _require(block.block_hash == block_hash, "hash map points at a stale block")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)
