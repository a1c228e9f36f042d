"""KVCacheManager: prefix hits, lazy allocation, freeing, forks."""
import pytest

from engine_core.kv_cache_manager import KVCacheManager
from tests.engine_core.factories import make_request


def manager(num_blocks=16, block_size=4, max_model_len=64, caching=True):
    return KVCacheManager(num_blocks, block_size, max_model_len, caching, "sha256")


def compute(kv, req, num_tokens):
    """Allocate and mark ``num_tokens`` more tokens computed, as a scheduled step does."""
    assert kv.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens


def test_repeated_prompt_hits_and_stats():
    kv = manager()
    first = make_request("a", 10)
    hits, num_hit = kv.get_computed_blocks(first)
    assert (len(hits), num_hit) == (0, 0)
    compute(kv, first, 10)
    kv.free(first)
    hits, num_hit = kv.get_computed_blocks(make_request("b", 10))
    assert (len(hits), num_hit) == (2, 8)
    stats = kv.prefix_cache_stats
    assert (stats.num_requests, stats.num_query_tokens, stats.num_hit_tokens) == (2, 20, 8)
    assert stats.hit_rate == 8 / 20
    interval = kv.make_prefix_cache_stats()
    assert interval.num_hit_tokens == 8
    assert kv.make_prefix_cache_stats().num_query_tokens == 0  # interval was reset
    assert kv.prefix_cache_stats.num_hit_tokens == 8  # cumulative stays


def test_hits_are_the_blocks_that_were_computed():
    kv = manager()
    first = make_request("a", 10)
    compute(kv, first, 10)
    owned = kv.get_block_ids("a")
    second = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(second)
    assert hits.get_block_ids() == owned[:2] and num_hit == 8
    assert kv.allocate_slots(second, 3, num_hit, hits) is not None
    assert kv.get_block_ids("b")[:2] == owned[:2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in owned[:2]] == [2, 2]


def test_never_the_whole_prompt():
    kv = manager()
    first = make_request("a", 8)
    compute(kv, first, 8)
    kv.free(first)
    _, num_hit = kv.get_computed_blocks(make_request("b", 8))
    assert num_hit == 4  # the last block is recomputed so the model produces logits
    _, num_hit = kv.get_computed_blocks(make_request("c", 9))
    assert num_hit == 8


def test_salt_and_lora_do_not_share():
    kv = manager()
    compute(kv, make_request("a", 12, cache_salt="t1"), 12)
    assert kv.get_computed_blocks(make_request("b", 12, cache_salt="t2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", 12))[1] == 0
    assert kv.get_computed_blocks(make_request("d", 12, cache_salt="t1", lora_id=1))[1] == 0
    assert kv.get_computed_blocks(make_request("e", 12, cache_salt="t1"))[1] == 8


def test_caching_off_finds_nothing():
    kv = manager(caching=False)
    compute(kv, make_request("a", 12), 12)
    assert kv.get_computed_blocks(make_request("b", 12))[1] == 0
    assert kv.prefix_cache_stats.num_requests == 0


def test_lazy_allocation():
    kv = manager(num_blocks=8)
    req = make_request("a", 5, max_tokens=10)
    assert len(kv.allocate_slots(req, 5)) == 2  # tokens 0..4 need blocks 0 and 1
    req.num_computed_tokens = 5
    req.append_output_token_ids([7])
    assert len(kv.allocate_slots(req, 1)) == 0  # slot 5 is in block 1
    req.num_computed_tokens = 6
    req.append_output_token_ids([7, 7])
    assert len(kv.allocate_slots(req, 2)) == 0
    req.num_computed_tokens = 8
    req.append_output_token_ids([7])
    assert len(kv.allocate_slots(req, 1)) == 1  # token 8 opens block 2
    assert len(kv.get_block_ids("a")) == 3


def test_allocation_failure_changes_nothing():
    kv = manager(num_blocks=4)  # 3 usable
    a = make_request("a", 8)
    compute(kv, a, 8)
    b = make_request("b", 8)
    before = (kv.num_free_blocks, kv.get_block_ids("b"))
    assert kv.allocate_slots(b, 8) is None
    assert (kv.num_free_blocks, kv.get_block_ids("b")) == before
    kv.block_pool.check_invariants()


def test_reviving_cached_free_hits_counts_against_free_blocks():
    kv = manager(num_blocks=4)  # 3 usable
    a = make_request("a", 9)
    compute(kv, a, 9)
    kv.free(a)  # 2 hashed blocks cached-free, 1 plain free
    b = make_request("b", list(range(8)) + [60, 61, 62, 63, 64])  # needs 4 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 5, num_hit, hits) is None  # 2 revived + 2 new > 3
    assert kv.allocate_slots(b, 4, num_hit, hits) is not None  # 2 revived + 1 new
    kv.block_pool.check_invariants()


def test_free_returns_everything_and_uncomputed_hashes_are_dropped():
    kv = manager()
    req = make_request("a", 12)
    assert kv.allocate_slots(req, 12) is not None  # registered for this step's K/V
    kv.free(req)  # freed before the step ran (num_computed_tokens still 0)
    assert kv.num_free_blocks == 15 and kv.usage == 0.0
    assert kv.get_computed_blocks(make_request("b", 12))[1] == 0
    kv.block_pool.check_invariants()


def test_freed_chain_is_evicted_tail_first():
    kv = manager(num_blocks=5)  # 4 usable
    req = make_request("a", 12)
    compute(kv, req, 12)  # 3 full, hashed blocks
    kv.free(req)
    kv.block_pool.get_new_blocks(2)  # the never-used block, then the chain's tail
    assert kv.get_computed_blocks(make_request("b", 12))[1] == 8  # head blocks survive


def test_fork_full_blocks_only_shares_by_reference():
    kv = manager()
    parent = make_request("p", 9)
    compute(kv, parent, 9)
    child = make_request("c", 9)
    result = kv.fork(parent, child, 8)
    assert result.num_computed_tokens == 8 and result.block_copy is None
    assert kv.get_block_ids("c") == kv.get_block_ids("p")[:2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in kv.get_block_ids("p")] == [2, 2, 1]


def test_fork_partial_block_is_copied_on_write():
    kv = manager()
    parent = make_request("p", 10)
    compute(kv, parent, 10)
    free_before = kv.num_free_blocks
    child = make_request("c", 10)
    result = kv.fork(parent, child, 9)
    parent_ids = kv.get_block_ids("p")
    child_ids = kv.get_block_ids("c")
    assert result.num_computed_tokens == 9
    assert result.block_copy.src == parent_ids[2] and result.block_copy.dst == child_ids[2]
    assert child_ids[:2] == parent_ids[:2] and child_ids[2] != parent_ids[2]
    assert kv.num_free_blocks == free_before - 1
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 15
    kv.block_pool.check_invariants()


def test_fork_without_free_block_shares_only_full_blocks():
    kv = manager(num_blocks=4)
    parent = make_request("p", 10)
    compute(kv, parent, 10)  # all 3 usable blocks
    result = kv.fork(parent, make_request("c", 10), 9)
    assert result.num_computed_tokens == 8 and result.block_copy is None
    assert kv.get_block_ids("c") == kv.get_block_ids("p")[:2]


def test_fork_rejects_uncomputed_tokens():
    kv = manager()
    parent = make_request("p", 10)
    compute(kv, parent, 4)
    with pytest.raises(ValueError):
        kv.fork(parent, make_request("c", 10), 9)


def test_reset_prefix_cache():
    kv = manager()
    req = make_request("a", 12)
    compute(kv, req, 12)
    assert kv.reset_prefix_cache() is False
    kv.free(req)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", 12))[1] == 0
