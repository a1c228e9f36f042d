"""An int8 KV cache (memory.kv_cache_dtype: int8): rows of head_dim int8 values with a
bfloat16 scale per token and KV head in their last two bytes (kernels/kv_quant.py)."""
import pytest
import torch

from kernels.kv_quant import (dequantize_int8_rows, load_kv, quantize_int8_rows,
                              round_through_cache, row_width)
from kernels.paged_attention import make_plan, paged_attention_reference
from kernels.reshape_and_cache import reshape_and_cache_reference
from tests.kernels.ragged_case import make_case


def test_rows_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, one all zero, one with a single outlier
    x = torch.randn(6, 3, 64, generator=gen) * torch.logspace(-5, 3, 6)[:, None, None]
    x[2, 1] = 0
    x[3, 0, 7] = 500.0
    rows = quantize_int8_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (6, 3, 66) == (6, 3, row_width(64,
                                                                                torch.int8))
    back = dequantize_int8_rows(rows, torch.float32)
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).float()
    amax = x.abs().amax(-1, keepdim=True)
    assert (scale * 127 >= amax).all()  # the stored scale never clips a value
    assert (scale * 127 <= amax * (1 + 2 ** -6) + 1e-27).all()  # and wastes little range
    assert ((back - x).abs() <= scale / 2 + 1e-12).all()
    assert torch.equal(back[2, 1], torch.zeros(64))
    assert back[3, 0, 7] == pytest.approx(500.0, rel=2 ** -8)
    assert rows[..., :64].abs().max() == 127  # the row's largest value uses the full range


def test_store_writes_rows_with_scales_and_skips_padding():
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 5, 2, 16, generator=gen).unbind(0)
    slots = torch.tensor([3, 0, -1, 9, 4])
    cache = torch.full((2, 3, 4, 2, 18), 7, dtype=torch.int8)
    reshape_and_cache_reference(key, value, cache, slots)
    flat = cache.view(2, 12, 2, 18)
    keep = slots >= 0
    assert torch.equal(load_kv(flat[0, slots[keep]], torch.float32),
                       round_through_cache(key[keep], torch.int8))
    assert torch.equal(flat[1, slots[keep]], quantize_int8_rows(value[keep]))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (flat[:, untouched] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_reads_int8_as_stored_and_close_to_float(dtype):
    block_size, heads, kv_heads, head_dim, window = 4, 6, 2, 32, None
    case = make_case([(0, 1), (9, 1), (0, 7), (5, 4), (13, 1)], block_size, heads, kv_heads,
                     head_dim, torch.float32)
    float_cache = case.kv_cache
    int8_cache = quantize_int8_rows(float_cache)  # NaN (never read) slots become garbage
    scale = head_dim ** -0.5
    plan = make_plan(case.query_start_loc, case.seq_lens, case.block_tables, block_size,
                     window)
    q, k, v = case.query.to(dtype), case.key.to(dtype), case.value.to(dtype)
    out = paged_attention_reference(q, k, v, int8_cache, plan, scale)
    assert out.dtype == dtype
    widened = dequantize_int8_rows(int8_cache, dtype)
    as_stored = paged_attention_reference(q, round_through_cache(k, torch.int8),
                                          round_through_cache(v, torch.int8), widened, plan,
                                          scale)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, as_stored, atol=tol, rtol=tol)
    exact = paged_attention_reference(q.float(), case.key, case.value, float_cache, plan,
                                      scale)
    # randn rows: |x| <= ~4, so each element moves by <= ~4/254; scores by far less than 1
    err = (out.float() - exact).abs().max()
    assert 0 < err < 0.05
