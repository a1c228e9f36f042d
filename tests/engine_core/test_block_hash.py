"""Chained block hashes: determinism, chaining, extra keys, incremental growth."""
import os
import subprocess
import sys

import pytest

from engine_core.block_hash import (encode_extra_keys, extend_block_hashes, hash_block_tokens,
                                    make_hash_fn)
from tests.engine_core.factories import make_request

sha = make_hash_fn("sha256")


def hashes_of(tokens, block_size=4, algorithm="sha256", **kw):
    req = make_request("r", tokens, **kw)
    extend_block_hashes(req, block_size, make_hash_fn(algorithm))
    return req.block_hashes


def test_digest_algorithms():
    assert len(hashes_of(range(8))[0]) == 32
    xx = hashes_of(range(8), algorithm="xxhash128")
    assert len(xx[0]) == 16 and xx == hashes_of(range(8), algorithm="xxhash128")
    with pytest.raises(ValueError):
        make_hash_fn("md5")


def test_only_full_blocks_are_hashed_and_growth_is_incremental():
    req = make_request("r", list(range(10)))
    assert extend_block_hashes(req, 4, sha) == 2
    first = list(req.block_hashes)
    req.append_output_token_ids([10, 11])
    assert extend_block_hashes(req, 4, sha) == 3
    assert req.block_hashes[:2] == first  # earlier hashes never change
    assert req.block_hashes == hashes_of(range(12))


def test_hashes_chain():
    base = hashes_of(range(12))
    changed_first = hashes_of([99] + list(range(1, 12)))
    changed_last = hashes_of(list(range(11)) + [99])
    assert all(a != b for a, b in zip(base, changed_first))  # every later block differs
    assert changed_last[:2] == base[:2] and changed_last[2] != base[2]
    # same tokens in block 1 but a different parent: a different hash
    assert hash_block_tokens(sha, b"p1", [1, 2]) != hash_block_tokens(sha, b"p2", [1, 2])


def test_cache_salt_and_lora_separate_every_block():
    base = hashes_of(range(12))
    for other in (hashes_of(range(12), cache_salt="tenant-a"),
                  hashes_of(range(12), cache_salt=""),
                  hashes_of(range(12), lora_id=3)):
        assert all(a != b for a, b in zip(base, other))
    assert hashes_of(range(12), cache_salt="a") != hashes_of(range(12), cache_salt="b")
    assert encode_extra_keys(0, None) != encode_extra_keys(0, "")


def test_hash_is_stable_across_processes():
    """Python's hash() is salted per process; block hashes must not be."""
    code = ("from engine_core.block_hash import *; from engine_core.request import Request;"
            "from engine_core.sampling_params import SamplingParams;"
            "r = Request('r', list(range(8)), SamplingParams(), cache_salt='s');"
            "extend_block_hashes(r, 4, make_hash_fn('sha256')); print(r.block_hashes[1].hex())")
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        digests.add(subprocess.check_output([sys.executable, "-c", code], env=env,
                                            cwd=os.getcwd(), text=True).strip())
    assert digests == {hashes_of(range(8), cache_salt="s")[1].hex()}
