"""The paged-attention reference against dense per-request attention."""
import math

import pytest
import torch

from kernels.paged_attention import make_plan, paged_attention
from kernels.reshape_and_cache import reshape_and_cache


def dense_attention(q, k, v, context_len, sliding_window=None):
    """q [q_len, H, d], k/v [seq_len, kvh, d]: causal attention, queries at the end."""
    q_len, num_heads, d = q.shape
    seq_len, kvh, _ = k.shape
    group = num_heads // kvh
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(d)
    q_pos = torch.arange(context_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


CASES = [
    # (block_size, num_heads, num_kv_heads, [(context_len, query_len), ...], window)
    (4, 4, 4, [(0, 1), (5, 1), (0, 7), (3, 4)], None),
    (16, 6, 2, [(16, 1), (31, 1), (0, 16), (17, 15)], None),  # full and near-full blocks
    (8, 8, 1, [(0, 3), (12, 1), (8, 8)], None),  # multi-query
    (4, 4, 2, [(9, 1), (0, 9), (6, 5)], 5),  # sliding window
    (2, 2, 2, [(0, 1)], None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,shapes,window", CASES)
def test_matches_dense(block_size, num_heads, num_kv_heads, shapes, window, dtype):
    torch.manual_seed(0)
    head_dim = 16
    # decodes first, as the runner lays them out
    shapes = sorted(shapes, key=lambda s: s[1] != 1)
    seqs = [(torch.randn(c + q, num_kv_heads, head_dim, dtype=dtype),
             torch.randn(c + q, num_kv_heads, head_dim, dtype=dtype),
             torch.randn(q, num_heads, head_dim, dtype=dtype), c) for c, q in shapes]
    max_blocks = max(-(-(c + q) // block_size) for c, q in shapes)
    num_blocks = 1 + max_blocks * len(shapes) + 3
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    # scatter each sequence over shuffled, non-contiguous blocks
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    qsl, seq_lens, queries, new_k, new_v, new_slots = [0], [], [], [], [], []
    for r, (k, v, q, c) in enumerate(seqs):
        n = -(-k.shape[0] // block_size)
        tables[r, :n] = torch.tensor(perm[r * max_blocks:r * max_blocks + n])
        pos = torch.arange(k.shape[0])
        slots = tables[r, pos // block_size] * block_size + pos % block_size
        reshape_and_cache(k[:c], v[:c], cache, slots[:c])  # cached context
        new_k.append(k[c:]); new_v.append(v[c:]); new_slots.append(slots[c:])
        queries.append(q)
        qsl.append(qsl[-1] + q.shape[0])
        seq_lens.append(k.shape[0])
    key, value = torch.cat(new_k), torch.cat(new_v)
    reshape_and_cache(key, value, cache, torch.cat(new_slots))
    plan = make_plan(qsl, seq_lens, tables, block_size, window)
    out = paged_attention(torch.cat(queries), key, value, cache, plan, head_dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for r, (k, v, q, c) in enumerate(seqs):
        ref = dense_attention(q, k, v, c, window)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]].double(), ref, atol=tol, rtol=tol)


def test_reshape_and_cache_writes_slots():
    cache = torch.zeros(2, 4, 2, 1, 3)
    key = torch.arange(6.0).view(2, 1, 3)
    reshape_and_cache(key, -key, cache, torch.tensor([5, 2]))
    assert torch.equal(cache[0, 2, 1], key[0]) and torch.equal(cache[0, 1, 0], key[1])
    assert torch.equal(cache[1, 2, 1], -key[0])
    assert cache[0].abs().sum() == key.sum()
