"""BlockPool and FreeBlockQueue: reference counts, LRU order, the null block."""
import pytest

from engine_core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_supports_middle_removal_and_both_ends():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    q.remove(blocks[4])
    q.append(blocks[4])
    assert ids(q) == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2]
    assert len(q) == 4 and not blocks[2].is_in_free_queue
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    got = pool.get_new_blocks(4)
    assert sorted(ids(got)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.touch([pool.null_block])
    pool.check_invariants()


def test_lru_eviction_takes_chain_tail_before_head():
    pool = BlockPool(6)
    chain = pool.get_new_blocks(3)
    pool.cache_full_blocks(chain, [b"h0", b"h1", b"h2"])
    pool.free_blocks(reversed(chain))  # the manager frees tail first
    # two never-used blocks are handed out first, then the chain's tail
    first_two = pool.get_new_blocks(2)
    assert chain[0] not in first_two and chain[2] not in first_two
    [evicted] = pool.get_new_blocks(1)
    assert evicted is chain[2]
    assert evicted.block_hash is None and pool.get_cached_block(b"h2") is None
    assert pool.get_cached_block(b"h0") is chain[0]
    assert pool.get_cached_block(b"h1") is chain[1]
    [evicted] = pool.get_new_blocks(1)
    assert evicted is chain[1]
    pool.check_invariants()


def test_unhashed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [b"ha"])
    pool.free_blocks([a])  # cached-free: goes to the tail
    pool.free_blocks([b])  # holds nothing: goes to the head
    [reused] = pool.get_new_blocks(1)
    assert reused is b
    assert pool.get_cached_block(b"ha") is a


def test_touch_revives_cached_free_block():
    pool = BlockPool(4)
    [a] = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"ha"])
    pool.free_blocks([a])
    assert a.is_in_free_queue and pool.num_free_blocks == 3
    pool.touch([pool.get_cached_block(b"ha")])
    assert a.ref_cnt == 1 and not a.is_in_free_queue and pool.num_free_blocks == 2
    pool.touch([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and not a.is_in_free_queue
    pool.check_invariants()


def test_over_free_is_an_error():
    pool = BlockPool(3)
    [a] = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h"])
    pool.cache_full_blocks([b], [b"h"])
    assert pool.get_cached_block(b"h") is a and b.block_hash is None
    pool.free_blocks([b, a])
    pool.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"])
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"ha") is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"ha") is None and a.block_hash is None
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(4)
    [a] = pool.get_new_blocks(1)
    pool.check_invariants()
    a.ref_cnt = 0  # owned by nobody, yet not free
    with pytest.raises(AssertionError):
        pool.check_invariants()
    a.ref_cnt = 1
    free = next(iter(pool.free_block_queue))
    free.ref_cnt = 1  # both free and owned
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    [a] = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"h"])
    assert pool.get_cached_block(b"h") is None
