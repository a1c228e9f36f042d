"""How many parts split-KV (flash decoding) cuts each request's keys into.

A decode-only batch of few requests gives the Triton kernel (kernels/triton_paged_attention.py)
``num_reqs * num_kv_heads`` programs, too few to fill a GPU: cutting each request's key
range into parts, each its own program, with a merge kernel after, puts the idle
multiprocessors to work. Plain Python, so plans are made without importing Triton.
"""
from __future__ import annotations

MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int,
                      max_seq_len: int, num_sms: int) -> int:
    """How many parts to cut each request's keys into (1 = no split-KV).

    Only decode-only batches split, and only when their ``num_reqs * num_kv_heads``
    programs would leave streaming multiprocessors idle; each part keeps at least
    MIN_KEYS_PER_SPLIT keys. A power of two, at most MAX_SPLITS.
    """
    programs = num_reqs * num_kv_heads
    if max_query_len != 1 or programs >= num_sms or max_seq_len < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    wanted = min(-(-num_sms // programs), max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1)  # round down to a power of two
