"""Chained content hashes of full KV blocks, the keys of the prefix cache.

    block i's hash = digest(parent tag | block i-1's hash or the request's extra keys
                            | block i's token ids)

Because every hash covers its parent's, equal hashes mean equal token prefixes, so a
lookup can stop at the first miss. The extra keys (LoRA adapter id, cache salt) sit
in block 0's key only; chaining carries them into every later block, so two salts or
two adapters never share a single block. Digests are sha256 or xxh3-128 over a fixed
byte encoding; Python's ``hash()`` is salted per process and never used.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from engine_core.request import Request

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

_ROOT_TAG = b"\x00"  # block 0: the extra keys follow
_CHILD_TAG = b"\x01"  # later blocks: the parent's digest follows


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def make_hash_fn(algorithm: str) -> HashFn:
    """The digest named by ``CacheConfig.hash_algorithm`` ("sha256" or "xxhash128")."""
    if algorithm == "sha256":
        return _sha256
    if algorithm == "xxhash128":
        import xxhash  # only needed when chosen

        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown block hash algorithm {algorithm!r}")


def encode_extra_keys(lora_id: int, cache_salt: str | None) -> bytes:
    """Bytes of the keys that change a block's K/V or its visibility.

    Length-prefixed, with None and "" kept apart, so distinct keys never encode alike.
    """
    out = struct.pack("<q", lora_id)
    if cache_salt is None:
        return out + b"\x00"
    salt = cache_salt.encode("utf-8")
    return out + b"\x01" + struct.pack("<I", len(salt)) + salt


def hash_block_tokens(hash_fn: HashFn, parent_hash: BlockHash | None,
                      token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """Hash one full block. ``extra_keys`` is only read for block 0 (no parent)."""
    if parent_hash is None:
        head = _ROOT_TAG + struct.pack("<I", len(extra_keys)) + extra_keys
    else:
        head = _CHILD_TAG + parent_hash
    body = struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)
    return hash_fn(head + body)


def _extend_chain(hashes: list[BlockHash], tokens: Sequence[int], block_size: int,
                  hash_fn: HashFn, extra_keys: bytes) -> int:
    """Append to ``hashes`` the hashes of ``tokens``' full blocks past those it holds."""
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(hash_fn, parent, tokens[i * block_size:(i + 1) * block_size],
                                   extra_keys)
        hashes.append(parent)
    return max(num_full, len(hashes))


def extend_block_hashes(request: Request, block_size: int, hash_fn: HashFn) -> int:
    """Append the hashes of ``request``'s full blocks not hashed yet; returns the total.

    Only blocks whose every token id is known (prompt or already sampled) are hashed,
    so ``request.block_hashes`` grows as outputs fill blocks and never changes.
    """
    hashes = request.block_hashes
    if len(hashes) >= len(request.all_token_ids) // block_size:
        return len(hashes)
    extra = encode_extra_keys(request.lora_id, request.cache_salt) if not hashes else b""
    return _extend_chain(hashes, request.all_token_ids, block_size, hash_fn, extra)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, hash_fn: HashFn,
                        lora_id: int = 0, cache_salt: str | None = None) -> list[BlockHash]:
    """The hashes of a prompt's full blocks, the very ones the engine core gives a
    request with these keys (the API's prefix-aware routing looks them up in what each
    replica reported caching)."""
    hashes: list[BlockHash] = []
    _extend_chain(hashes, token_ids, block_size, hash_fn,
                  encode_extra_keys(lora_id, cache_salt))
    return hashes
