"""The Triton ragged paged-attention kernel against the torch reference (the spec).

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 there); with a GPU and TRITON_INTERPRET=0 the same tests run the
compiled kernel. Shapes stay small: the interpreter pays per program and per op.
"""
import pytest
import torch

from kernels.paged_attention import make_ragged_plan, paged_attention
from kernels.split_kv import choose_num_splits
from kernels.triton_paged_attention import ragged_paged_attention, tile_shape
from tests.kernels.ragged_case import DEVICE, make_case

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

CASES = {
    # name: (block_size, num_heads, num_kv_heads, head_dim,
    #        [(context_len, query_len), ...], window, num_splits, block_n)
    "mha-tiny-pages": (4, 4, 4, 32, [(0, 1), (5, 1), (0, 7), (3, 4)], None, 1, 16),
    "gqa3-full-blocks": (16, 6, 2, 64, [(16, 1), (31, 1), (0, 16), (17, 15), (32, 32)],
                         None, 1, 64),
    "mqa8": (8, 8, 1, 32, [(0, 3), (12, 1), (8, 8)], None, 1, 16),
    "window": (4, 4, 2, 32, [(9, 1), (0, 9), (6, 5)], 5, 1, 16),
    "smollm-window-chunks": (32, 9, 3, 64, [(40, 1), (0, 1), (70, 20), (0, 45)], 17, 1, 32),
    "head-dim-48": (16, 4, 2, 48, [(20, 1), (3, 13)], None, 1, 16),
    "page-128-over-tiles": (128, 4, 2, 32, [(100, 1), (200, 1), (0, 50)], None, 1, 64),
    "split-kv": (16, 3, 1, 64, [(200, 1), (63, 1), (0, 1), (130, 1)], None, 4, 32),
    "split-kv-window": (16, 4, 2, 32, [(150, 1), (40, 1)], 50, 2, 16),
    "split-kv-mixed": (8, 4, 1, 32, [(70, 1), (20, 12)], None, 2, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype):
    block_size, heads, kv_heads, head_dim, shapes, window, splits, block_n = CASES[name]
    case = make_case(shapes, block_size, heads, kv_heads, head_dim, dtype)
    tables, seq_lens, qsl = case.device_metadata()
    scale = head_dim ** -0.5
    out = ragged_paged_attention(case.query, case.kv_cache, tables, seq_lens, qsl,
                                 case.max_query_len, scale, window, splits, block_n)
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(out.cpu().float(), case.reference(scale, window).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_plan_dispatch_and_split_heuristic():
    """make_ragged_plan packs the batch for the kernel; paged_attention dispatches to it."""
    shapes = [(600, 1), (90, 1)]
    case = make_case(shapes, 16, 6, 2, 32, torch.float32, seed=3)
    plan = make_ragged_plan(case.query_start_loc, case.seq_lens, case.block_tables.numpy(),
                            DEVICE, num_kv_heads=2, num_sms=132)
    meta = plan.ragged
    assert meta.num_splits > 1 and meta.max_query_len == 1
    assert meta.query_start_loc.dtype == torch.int32
    assert meta.query_start_loc.tolist() == case.query_start_loc
    assert meta.seq_lens.tolist() == case.seq_lens
    assert torch.equal(meta.block_tables.cpu().long(), case.block_tables)
    out = paged_attention(case.query, case.key, case.value, case.kv_cache, plan, 0.2)
    torch.testing.assert_close(out.cpu(), case.reference(0.2, None), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 2])
def test_padding_requests_get_zeros(splits):
    """CUDA-graph padding: one query token, seq_len 0, null block table -> zeros."""
    case = make_case([(20, 1), (5, 1)], 8, 4, 2, 32, torch.float32, seed=1)
    tables, seq_lens, qsl = case.device_metadata()
    pad = 3
    query = torch.cat([case.query, torch.randn(pad, 4, 32, device=DEVICE)])
    tables = torch.cat([tables, torch.zeros(pad, tables.shape[1], dtype=torch.int32,
                                            device=DEVICE)])
    seq_lens = torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32, device=DEVICE)])
    qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    out = ragged_paged_attention(query, case.kv_cache, tables, seq_lens, qsl, 1, 0.3,
                                 num_splits=splits, block_n=16).cpu()
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    torch.testing.assert_close(out[:2], case.reference(0.3, None), atol=2e-5, rtol=2e-5)


def test_strided_query_view():
    """Queries may be a column slice of the fused qkv output (token stride != H * hd)."""
    case = make_case([(10, 1), (0, 6)], 4, 4, 2, 16, torch.float32, seed=2)
    qkv = torch.randn(case.query.shape[0], 4 * 16 + 64, device=DEVICE)
    qkv[:, :64] = case.query.reshape(-1, 64)
    query = qkv[:, :64].view(-1, 4, 16)
    tables, seq_lens, qsl = case.device_metadata()
    out = ragged_paged_attention(query, case.kv_cache, tables, seq_lens, qsl, 6, 0.25)
    torch.testing.assert_close(out.cpu(), case.reference(0.25, None), atol=2e-5, rtol=2e-5)


def test_tile_shape():
    assert tile_shape(group=3, max_query_len=1) == (16, 5)
    assert tile_shape(group=3, max_query_len=7) == (64, 21)
    assert tile_shape(group=1, max_query_len=1) == (16, 16)
    assert tile_shape(group=32, max_query_len=1) == (32, 1)
    assert tile_shape(group=128, max_query_len=9) == (128, 1)


def test_choose_num_splits():
    # a lone long decode on a 132-SM GPU: as many parts as the keys allow, power of two
    assert choose_num_splits(1, 3, 1, 8192, 132) == 16
    assert choose_num_splits(1, 3, 1, 1024, 132) == 4
    assert choose_num_splits(4, 3, 1, 100_000, 132) == 8  # 12 programs -> 11 wanted -> 8
    # enough programs, short contexts, or prefill chunks in the batch: no split
    assert choose_num_splits(64, 3, 1, 8192, 132) == 1
    assert choose_num_splits(1, 3, 1, 300, 132) == 1
    assert choose_num_splits(1, 3, 2, 8192, 132) == 1
    for n in range(1, 50):
        s = choose_num_splits(n, 2, 1, 4096, 108)
        assert s & (s - 1) == 0 and 1 <= s <= 16


def test_empty_batch():
    cache = torch.zeros(2, 2, 4, 1, 16, device=DEVICE)
    q = torch.zeros(0, 2, 16, device=DEVICE)
    z = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    out = ragged_paged_attention(q, cache, z.view(0, 1), z, torch.zeros(1, dtype=torch.int32),
                                 1, 1.0)
    assert out.shape == (0, 2, 16)
