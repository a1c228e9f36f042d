"""Per-request block tables on top of the block pool: prefix hits, lazy growth, forks.

A request's block table covers its computed tokens plus the tokens scheduled this
step, and only grows (append-only), but for one case: blocks that held only rejected
draft tokens (speculative decoding) are dropped off its end. With ``block_size`` 4:

    tokens     t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    blocks     [  full 0   ] [  full 1   ] [partial 2]
    hashes     h0            h1            (none until t8..t11 are all known)

Blocks are registered in the prefix cache as soon as they are full of known tokens
that are computed by the end of the current step. Draft tokens are not known tokens
(they are not in ``all_token_ids``), so a block holding an unverified draft is never
hashed. The runner writes every scheduled
token's K/V of a layer before attention reads that layer, so a request admitted in
the same step may already hit such a block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.block_hash import extend_block_hashes, make_hash_fn
from engine_core.block_pool import BlockPool, KVCacheBlock
from engine_core.request import Request
from engine_core.scheduler_output import BlockCopy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class KVCacheBlocks:
    """A run of blocks handed to (or found for) one request."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens as vLLM reports them."""

    num_requests: int = 0  # lookups done
    num_query_tokens: int = 0  # tokens the lookups asked about
    num_hit_tokens: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(slots=True)
class ForkResult:
    """What a fork gave the child.

    ``num_computed_tokens`` is how many leading tokens the child may treat as computed
    (its block table already covers them). ``block_copy`` is set when the child got a
    private copy of the parent's partly filled block. It must travel in the very next
    SchedulerOutput: the runner copies before that step's forward, so the source block
    may already be freed, or even handed to another request in that same step.
    """

    num_computed_tokens: int
    block_copy: BlockCopy | None = None


class KVCacheManager:
    """Block tables of all live requests over one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, hash_algorithm: str = "sha256"):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_fn = make_hash_fn(hash_algorithm)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request were offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Blocks dropped off a table (rejected drafts) that the runner has not been told of.
        self.num_dropped_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()  # since start
        self._interval_stats = PrefixCacheStats()  # since make_prefix_cache_stats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request,
                            record_stats: bool = True) -> tuple[KVCacheBlocks, int]:
        """Longest run of cached full blocks that prefixes ``request``'s tokens.

        The last known token is never served from the cache (the model must compute it
        to produce logits), so a fully cached prompt loses its last block. Returns the
        blocks (not yet referenced; allocate_slots touches them) and their token count.
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        extend_block_hashes(request, self.block_size, self.hash_fn)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if record_stats:
            self.record_prefix_query(request, num_hit_tokens)
        return KVCacheBlocks(hits), num_hit_tokens

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one lookup of ``request`` that found ``num_hit_tokens`` tokens."""
        if not self.enable_caching:
            return
        for stats in (self.prefix_cache_stats, self._interval_stats):
            stats.num_requests += 1
            stats.num_query_tokens += request.num_tokens
            stats.num_hit_tokens += num_hit_tokens

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups since the previous call (for periodic metrics); resets the interval."""
        stats, self._interval_stats = self._interval_stats, PrefixCacheStats()
        return stats

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None
                       ) -> KVCacheBlocks | None:
        """Grow ``request``'s table to hold its computed tokens plus ``num_new_tokens``.

        ``new_computed_blocks``/``num_new_computed_tokens`` are prefix hits from
        get_computed_blocks() for a request that holds no blocks yet. Returns the newly
        allocated blocks, or None (and changes nothing) if the pool is too short.
        """
        hits = new_computed_blocks.blocks if new_computed_blocks else []
        req_blocks = self.req_to_blocks.get(request.req_id, [])
        if hits and req_blocks:
            raise ValueError("prefix hits are only valid for a request holding no blocks")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        num_new_blocks = max(0, cdiv(num_needed_tokens, self.block_size)
                             - len(req_blocks) - len(hits))
        # Reviving a cached-free hit takes it out of the free queue too.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        req_blocks.extend(hits)
        req_blocks.extend(new_blocks)
        num_known = min(num_computed + num_new_tokens, request.num_tokens)
        self._cache_full_blocks(request, num_known // self.block_size)
        return KVCacheBlocks(new_blocks)

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(request.req_id, 0)
        if num_full_blocks <= start:
            return
        extend_block_hashes(request, self.block_size, self.hash_fn)
        blocks = self.req_to_blocks[request.req_id][start:num_full_blocks]
        self.block_pool.cache_full_blocks(blocks,
                                          request.block_hashes[start:num_full_blocks])
        self.num_cached_blocks[request.req_id] = num_full_blocks

    def drop_blocks_after(self, request: Request, num_tokens: int) -> int:
        """Free the blocks of ``request`` past its first ``num_tokens`` tokens.

        Speculative decoding: blocks that held only rejected drafts. They are private
        (shared blocks hold computed prefixes) and never hashed (a hash covers known
        tokens only), so they go back to the pool's head. The runner learns of it from
        the next CachedRequestData (``take_dropped_blocks``). Returns how many.
        """
        blocks = self.req_to_blocks.get(request.req_id)
        num_keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= num_keep:
            return 0
        dropped = blocks[num_keep:]
        del blocks[num_keep:]
        for block in dropped:
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise ValueError(f"block {block.block_id} of {request.req_id} is shared or "
                                 f"hashed: it cannot hold only rejected drafts")
        self.block_pool.free_blocks(reversed(dropped))
        self.num_dropped_blocks[request.req_id] = (
            self.num_dropped_blocks.get(request.req_id, 0) + len(dropped))
        return len(dropped)

    def take_dropped_blocks(self, req_id: str) -> int:
        """Blocks dropped off ``req_id``'s table since the last call (for the runner)."""
        return self.num_dropped_blocks.pop(req_id, 0)

    def free(self, request: Request) -> None:
        """Return ``request``'s blocks to the pool, chain tail first.

        Blocks past ``request.num_computed_tokens`` were registered for K/V that this
        step would have written; a request freed before the step runs (preempted while
        scheduling) must not leave them findable, so their hashes are dropped.
        """
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_blocks.pop(request.req_id, None)
        self.num_dropped_blocks.pop(request.req_id, None)
        if not blocks:
            return
        for block in blocks[request.num_computed_tokens // self.block_size:]:
            if block.ref_cnt == 1:
                self.block_pool.drop_hash(block)
        self.block_pool.free_blocks(reversed(blocks))

    def lends_pending_blocks(self, request: Request) -> bool:
        """Whether another request holds one of ``request``'s blocks past its computed
        tokens: a prefix hit taken this step on K/V that only ``request``'s grant in
        this step would write. Preempting ``request`` now would leave that holder
        counting K/V nobody computes, so such a request is not preempted this step."""
        blocks = self.req_to_blocks.get(request.req_id, [])
        return any(b.ref_cnt > 1
                   for b in blocks[request.num_computed_tokens // self.block_size:])

    def fork(self, parent: Request, child: Request, num_shared_tokens: int) -> ForkResult:
        """Give ``child`` the parent's K/V for its first ``num_shared_tokens`` tokens.

        Full blocks are shared by reference. A partly filled last block is copied on
        write: the child gets a fresh block and a BlockCopy from the parent's. Without
        a free block the child shares only the full blocks and recomputes the rest.
        """
        if child.req_id in self.req_to_blocks:
            raise ValueError(f"request {child.req_id} already holds blocks")
        if num_shared_tokens > parent.num_computed_tokens:
            raise ValueError("cannot share tokens the parent has not computed")
        parent_blocks = self.req_to_blocks.get(parent.req_id, [])
        num_full, num_partial = divmod(num_shared_tokens, self.block_size)
        shared = parent_blocks[:num_full]
        self.block_pool.touch(shared)
        child_blocks = list(shared)
        result = ForkResult(num_full * self.block_size)
        if num_partial and self.block_pool.num_free_blocks > 0:
            [copy] = self.block_pool.get_new_blocks(1)
            child_blocks.append(copy)
            result = ForkResult(num_shared_tokens,
                                BlockCopy(src=parent_blocks[num_full].block_id,
                                          dst=copy.block_id))
        if child_blocks:
            self.req_to_blocks[child.req_id] = child_blocks
            self.num_cached_blocks[child.req_id] = min(
                num_full, self.num_cached_blocks.get(parent.req_id, 0))
        return result

    def get_block_ids(self, req_id: str) -> list[int]:
        """The block table of ``req_id`` (empty if it holds no blocks)."""
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def num_blocks_of(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, ()))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while any block is owned."""
        return self.block_pool.reset_prefix_cache()
