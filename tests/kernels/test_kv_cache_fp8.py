"""An fp8 KV cache (memory.kv_cache_dtype): rounding on store, widening on load.

Stores (torch reference and Triton) must give the format's round-to-nearest-even with
saturation; every attention path must read the cache's values exactly as stored, so
its output equals the float reference run on the widened cache, and stays within a
bound derived from the format's rounding of the float cache's attention.
"""
import math

import pytest
import torch

from kernels.kv_quant import fp8_mantissa_bits, quantize_kv, round_through_cache
from kernels.paged_attention import make_plan, paged_attention_reference
from kernels.reshape_and_cache import reshape_and_cache_reference
from kernels.triton_reshape_and_cache import reshape_and_cache_triton
from kernels.triton_paged_attention import ragged_paged_attention
from tests.kernels.ragged_case import DEVICE, make_case

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


def unit_roundoff(dtype) -> float:
    """Largest relative rounding error of a normal number: half an ulp."""
    return 2.0 ** -(fp8_mantissa_bits(dtype) + 1)


def subnormal_step(dtype) -> float:
    """Spacing of the subnormals: the largest absolute rounding error below the normals."""
    return torch.finfo(dtype).smallest_normal * 2.0 ** -fp8_mantissa_bits(dtype)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("store", ["reference", "triton"])
def test_store_rounds_saturates_and_skips_padding(dtype, store):
    gen = torch.Generator().manual_seed(1)
    num_tokens, kvh, hd, block_size, num_blocks = 11, 2, 32, 4, 5
    # magnitudes from subnormal to far beyond the format's range
    scales = torch.logspace(-4, 6, num_tokens)[:, None, None]
    key = torch.randn(num_tokens, kvh, hd, generator=gen) * scales
    value = torch.randn(num_tokens, kvh, hd, generator=gen) * scales
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # padding: writes nothing
    cache = torch.full((2, num_blocks, block_size, kvh, hd), 7.0).to(dtype)  # "unwritten"
    if store == "triton":
        cache = cache.to(DEVICE)
        reshape_and_cache_triton(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE))
        cache = cache.cpu()
    else:
        reshape_and_cache_reference(key, value, cache, slots)
    flat = cache.float().view(2, -1, kvh, hd)
    keep = slots >= 0
    limit = torch.finfo(dtype).max
    for plane, x in ((0, key), (1, value)):
        stored = flat[plane, slots[keep]]
        want = x[keep].clamp(-limit, limit)
        assert torch.isfinite(stored).all()
        err = (stored - want).abs()
        assert (err <= unit_roundoff(dtype) * want.abs() + subnormal_step(dtype)).all()
        # normal numbers round exactly as torch's cast (the interpreter's own fp8 cast
        # is wrong; the kernel pre-rounds in float32)
        normal = want.abs() >= torch.finfo(dtype).smallest_normal
        assert torch.equal(stored[normal], want.to(dtype).float()[normal])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (flat[:, untouched] == 7.0).all()  # the padding token and free slots


def test_round_through_cache_is_free_for_the_model_dtype():
    x = torch.randn(5, 2, 8)
    assert round_through_cache(x, torch.float32) is x
    y = round_through_cache(x, torch.float8_e4m3fn)
    assert y.dtype == torch.float32 and torch.equal(y, quantize_kv(x, torch.float8_e4m3fn).float())


def _fp8_case(name_shapes, dtype, kv_dtype):
    block_size, heads, kv_heads, head_dim, shapes, window = name_shapes
    case = make_case(shapes, block_size, heads, kv_heads, head_dim, dtype)
    float_cache = case.kv_cache.cpu()
    fp8_cache = quantize_kv(float_cache, kv_dtype)
    return case, float_cache, fp8_cache, window


def _reference(case, cache, window, key=None, value=None):
    scale = case.query.shape[-1] ** -0.5
    plan = make_plan(case.query_start_loc, case.seq_lens, case.block_tables, cache.shape[2],
                     window)
    key = case.key.cpu() if key is None else key
    value = case.value.cpu() if value is None else value
    return paged_attention_reference(case.query.cpu(), key, value, cache, plan, scale)


def _format_bound(case, float_cache, kv_dtype, window):
    """Per output row: how far the attention over the rounded cache may move.

    Every stored element is x(1 + e) + a with |e| <= u and |a| <= the subnormal step.
    Scores move by at most D = scale * sum_i |q_i| (u |k_i| + a), so each softmax weight
    by a factor within exp(+-2D): the output moves by at most (exp(2D) - 1) max|v|
    through the weights plus u max|v| + a through the values themselves.
    """
    u, a = unit_roundoff(kv_dtype), subnormal_step(kv_dtype)
    scale = case.query.shape[-1] ** -0.5
    plan = make_plan(case.query_start_loc, case.seq_lens, case.block_tables,
                     float_cache.shape[2], window)
    k_flat, v_flat = float_cache.view(2, -1, *float_cache.shape[3:])
    q = case.query.cpu().float()
    group = q.shape[1] // k_flat.shape[1]
    bounds = torch.zeros(q.shape[:2])
    qsl = case.query_start_loc
    for r in range(len(case.seq_lens)):
        pos = torch.arange(case.seq_lens[r])
        slots = case.block_tables[r, pos // float_cache.shape[2]] * float_cache.shape[2] \
            + pos % float_cache.shape[2]
        k = k_flat[slots].float().abs().repeat_interleave(group, 1)  # [L, H, hd]
        v_max = v_flat[slots].float().abs().amax(dim=(0, 2)).repeat_interleave(group)
        for t in range(qsl[r], qsl[r + 1]):
            d = scale * torch.einsum("hd,lhd->hl", q[t].abs(), u * k + a).amax(-1)
            bounds[t] = (torch.exp(2 * d) - 1) * v_max + u * v_max + a
    del plan
    return bounds


SHAPES = {
    # (block_size, heads, kv_heads, head_dim, [(context_len, query_len)], window)
    "gqa-mixed": (4, 4, 2, 32, [(0, 1), (9, 1), (0, 7), (5, 4)], None),
    "smollm-window": (16, 9, 3, 64, [(40, 1), (20, 12)], 17),
}


@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_reference_reads_the_cache_as_stored(name, kv_dtype):
    case, float_cache, fp8_cache, window = _fp8_case(SHAPES[name], torch.float32, kv_dtype)
    out = _reference(case, fp8_cache, window)
    # the spec of a quantized read: the float reference over the widened cache, with
    # this step's fresh keys rounded the same way
    widened = _reference(case, fp8_cache.float(), window,
                         round_through_cache(case.key.cpu(), kv_dtype),
                         round_through_cache(case.value.cpu(), kv_dtype))
    torch.testing.assert_close(out, widened, atol=2e-6, rtol=2e-6)
    # and within what the format's rounding can do to the float cache's attention
    exact = _reference(case, float_cache, window)
    err = (out - exact).abs().amax(-1)
    bound = _format_bound(case, float_cache, kv_dtype, window)
    assert (err <= bound + 1e-5).all(), float((err - bound).max())
    assert err.max() > 0  # the rounding did reach the output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_dtype", FP8, ids=FP8_IDS)
def test_triton_matches_reference_on_fp8_cache(kv_dtype, dtype):
    case, _, fp8_cache, window = _fp8_case(SHAPES["gqa-mixed"], dtype, kv_dtype)
    tables, seq_lens, qsl = case.device_metadata()
    scale = case.query.shape[-1] ** -0.5
    out = ragged_paged_attention(case.query, fp8_cache.to(DEVICE), tables, seq_lens, qsl,
                                 case.max_query_len, scale, window, 1, 16)
    assert out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), _reference(case, fp8_cache, window).float(),
                               atol=tol, rtol=tol)


def test_unit_roundoff_matches_torch():
    for dtype in FP8:
        x = torch.tensor([1.0 + unit_roundoff(dtype) * 0.99, 1.0 + unit_roundoff(dtype) * 1.01])
        got = x.to(dtype).float()
        assert got[0] == 1.0 and got[1] > 1.0
        assert math.isclose(float(torch.finfo(dtype).eps), 2 * unit_roundoff(dtype))
