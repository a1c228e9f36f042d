"""The prefix cache's change log (engine_core/kv_events.py): what a data-parallel
engine core tells the API about its cached blocks, and that the API's own hashes of a
prompt are the engine's."""
from engine_core.block_hash import make_hash_fn, prompt_block_hashes
from engine_core.block_pool import BlockPool
from engine_core.kv_events import KVEventLog
from engine_core.sampling_params import SamplingParams
from tests.engine_core.factories import make_engine


def test_log_keeps_each_hashes_latest_state_and_a_reset():
    log = KVEventLog()
    assert not log.drain()
    log.on_stored(b"a")
    log.on_stored(b"b")
    log.on_removed(b"a")
    log.on_removed(b"c")
    log.on_stored(b"c")
    events = log.drain()
    assert sorted(events.stored) == [b"b", b"c"] and events.removed == [b"a"]
    assert not events.is_cleared and not log.drain()
    log.on_stored(b"d")
    log.on_cleared()
    log.on_stored(b"e")
    events = log.drain()
    assert events.is_cleared and events.stored == [b"e"] and events.removed == []


def test_pool_logs_registrations_evictions_and_resets():
    pool = BlockPool(4)
    pool.events = KVEventLog()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:2], [b"h0", b"h1"])
    pool.cache_full_blocks(blocks[2:], [b"h0"])  # a duplicate stays unregistered
    assert sorted(pool.events.drain().stored) == [b"h0", b"h1"]
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(3)  # takes the unhashed block, then evicts h1's and h0's
    events = pool.events.drain()
    assert sorted(events.removed) == [b"h0", b"h1"] and not events.stored
    pool2 = BlockPool(3)
    pool2.events = KVEventLog()
    [b] = pool2.get_new_blocks(1)
    pool2.cache_full_blocks([b], [b"x"])
    pool2.free_blocks([b])
    assert pool2.reset_prefix_cache()
    assert pool2.events.drain().is_cleared and not pool2.cached_blocks


def test_api_side_prompt_hashes_are_what_the_engine_caches():
    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    pool = engine.scheduler.kv_cache_manager.block_pool
    pool.events = KVEventLog()
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    stored = set(pool.events.drain().stored)
    ours = prompt_block_hashes(prompt, 4, make_hash_fn("sha256"), 0, "tenant-a")
    assert len(ours) == 3 and set(ours) <= stored
    assert not set(prompt_block_hashes(prompt, 4, make_hash_fn("sha256"))) & stored
