"""The quantized linear kernel (``torch.ops.folio.quant_linear``) against torch references.

Two references, both float64, and two tolerances:

* exact: ``reference()`` computes with x quantized exactly as the int8 routes do (per
  block of 32, scale max|x|/127, round half to even), so the kernel differs from it only
  by float32 rounding: the integer dot products are exact, and per block a product
  ``d * xd``, the min term (Q4_1) and two fused multiply-adds round. The sum over B
  blocks is within (B + 4) * eps32 of the sum of the terms' magnitudes (the standard
  bound for a sequential float sum), with each term bounded by |x| |d (q - offset)| and
  |x| |m|.
* dequantised: ``x @ dequantize(W).T``, the model's weights as llama.cpp and
  transformers dequantise them. The int8 routes move each activation by at most half a
  quantization step (max|x| of its block / 254), so the difference is at most
  ``activation_rounding_bound`` (sum over blocks of that step times sum |w| of the
  block), plus the float32 term above. The widening route keeps x in float32: float32
  rounding only.
"""
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from kernels import cpu_extension
from kernels import quant_linear as ql

if os.environ.get(cpu_extension.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpu_extension.DISABLE_ENV} is set", allow_module_level=True)

EPS32 = torch.finfo(torch.float32).eps
GGML = {ql.Q4_0: T.Q4_0, ql.Q4_1: T.Q4_1, ql.Q8_0: T.Q8_0, ql.Q4_K: T.Q4_K, ql.Q6_K: T.Q6_K}
# SmolLM2's layers: fused q/k/v, o, fused gate/up, down (Q4_1 in the GGUF), LM head (Q8_0)
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.fixture(scope="module")
def ops():
    assert cpu_extension.is_available(), cpu_extension.unavailable_reason()
    return cpu_extension.require()


def random_blocks(n: int, k: int, fmt: int, seed: int) -> torch.Tensor:
    """GGUF bytes [n, k/32 * block] of random quants and plausible fp16 scales (K-quants:
    random 6- and 8-bit scales under a plausible d, and dmin, per 256 values)."""
    g = torch.Generator().manual_seed(seed)
    if fmt in ql.K_QUANTS:
        blocks = torch.randint(0, 256, (n, k // 256, ql._GGUF_BLOCK_BYTES[fmt]), generator=g,
                               dtype=torch.uint8)
        d = (torch.rand(n, k // 256, 2, generator=g) * 1e-3 + 1e-4).half().view(torch.uint8)
        if fmt == ql.Q4_K:
            blocks[..., :4] = d.reshape(n, k // 256, 4)
        else:
            blocks[..., 208:] = d[..., :2]
        return blocks.reshape(n, -1)
    blocks = torch.randint(0, 256, (n, k // 32, ql._GGUF_BLOCK_BYTES[fmt]), generator=g,
                           dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, 2, generator=g) * 0.02 + 1e-3).half()
    if fmt == ql.Q4_1:
        scales[..., 1] = -8 * scales[..., 0]  # m: centre the values like real weights
    count = 2 if fmt == ql.Q4_1 else 1
    blocks[..., :2 * count] = scales[..., :count].contiguous().view(torch.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("fmt", [ql.Q4_0, ql.Q4_1, ql.Q8_0])
@pytest.mark.parametrize("n", [16, 40, 96])
def test_packing_keeps_gguf_values_bit_for_bit(fmt, n):
    w = np.random.default_rng(n).standard_normal((n, 96)).astype(np.float32)
    raw = gguf_quantize(w, GGML[fmt])
    expected = torch.from_numpy(gguf_dequantize(raw, GGML[fmt]))
    packed = ql.pack_gguf_blocks(torch.from_numpy(raw), fmt, 96)
    assert packed.nbytes == -(-n // 16) * 16 * raw.shape[1]  # GGUF's bytes, rows padded to 16
    assert torch.equal(ql.dequantize(packed), expected)
    rows = torch.tensor([n - 1, 0, 17 % n, 5])
    assert torch.equal(ql.dequantize(packed, rows), expected[rows])


def k_quant_magnitudes(packed):
    """Per weight of a K-quant, |D u| + |D| offset + |M|: every term a route sums."""
    rows = torch.arange(packed.n)
    u = ql._stored_values(packed, rows // 16, rows % 16).float().view(packed.n, -1, 2, 16)
    D, M = ql._block_scales(packed, rows // 16, rows % 16)
    D, M = D.abs()[..., None], M.abs()[..., None]
    return (u * D + ql._OFFSET[packed.fmt] * D + M).reshape(packed.n, packed.k)


def float32_error(x, packed, w_abs):
    """(B + 4) eps32 times the sum of the magnitudes of the terms, [M, n] (float32 is
    plenty for a bound): |x^| |d (q - offset)| <= |x^| (|w| + |m|) per weight and
    |x^| |m| for the min, with |x^| <= |x| + a half step covering either route's x.
    (K-quants: :func:`k_quant_magnitudes` for every term.)"""
    xb = x.float().abs().reshape(x.shape[0], -1, 32)
    seen = (xb + xb.amax(dim=-1, keepdim=True) / 254).reshape(x.shape)
    if packed.fmt in ql.K_QUANTS:
        return ((packed.k // 32 + 4) * EPS32 * (seen @ k_quant_magnitudes(packed).t())).double() + 1e-6
    magnitude = seen @ w_abs.t()
    if packed.fmt == ql.Q4_1:
        m = packed.scales[:, :, 16:].float().permute(0, 2, 1).reshape(-1, packed.k // 32)
        magnitude += 2 * xb.sum(dim=-1) @ m[:packed.n].abs().t()
    return (packed.k // 32 + 4) * EPS32 * magnitude.double() + 1e-6


def check_route(ops, x, packed, route, expected, within, bias=None):
    out = ops.quant_linear(x, packed.qs, packed.scales, packed.fmt, packed.n, bias, route)
    assert out.shape == (x.shape[0], packed.n) and out.dtype == x.dtype
    assert ((out.double() - expected).abs() <= within).all()


def dequantised_weights(packed):
    """The weight as float64 and its magnitudes as float32 (the bounds' operand)."""
    w = ql.dequantize(packed)
    return w.double(), w.abs()


def check_all_routes(ops, x, packed, bias=None, skip_scalar=False, weights=None):
    """Each built route against the exact and the dequantised references."""
    w, w_abs = weights or dequantised_weights(packed)
    error = float32_error(x, packed, w_abs)
    dequantised = ql.reference(x, packed, bias, ql.WIDEN, w)
    for route in ql.routes_available():
        if route == ql.SCALAR and skip_scalar:
            continue
        top = ql.levels(route, packed.fmt)
        if top is None:
            check_route(ops, x, packed, route, dequantised, error, bias)  # float32 x
        else:  # its own rounding of x exactly, and within that rounding of the product
            as_seen = ql.reference(x, packed, bias, route, w)
            rounding = ql.activation_rounding_bound(x, packed, w_abs, top)
            check_route(ops, x, packed, route, as_seen, error, bias)
            check_route(ops, x, packed, route, dequantised, rounding + error, bias)


@pytest.mark.parametrize("fmt", [ql.Q4_1, ql.Q8_0])
@pytest.mark.parametrize("n,k", MODEL_SHAPES)
def test_every_model_shape_and_route_within_the_formats_rounding(ops, fmt, n, k):
    packed = ql.pack_gguf_blocks(random_blocks(n, k, fmt, n + k), fmt, k)
    weights = dequantised_weights(packed)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 4, 32, 64):
        # plain C++ runs the small cases only (the same arithmetic, far slower)
        check_all_routes(ops, torch.randn(rows, k, generator=g), packed,
                         skip_scalar=rows * n > 4 * 3072, weights=weights)


@pytest.mark.parametrize("fmt", [ql.Q4_K, ql.Q6_K])
@pytest.mark.parametrize("n,k", [(576, 1536), (48, 2048)])  # SmolLM2's down_proj; 1B's k
def test_k_quants_every_route_within_the_formats_rounding(ops, fmt, n, k):
    packed = ql.pack_gguf_blocks(random_blocks(n, k, fmt, n + k), fmt, k)
    weights = dequantised_weights(packed)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 4, 32):
        check_all_routes(ops, torch.randn(rows, k, generator=g), packed,
                         skip_scalar=rows * n > 4 * 576, weights=weights)


@pytest.mark.parametrize("fmt", [ql.Q4_K, ql.Q6_K])
def test_k_quants_stay_as_small_as_the_gguf(fmt):
    raw = random_blocks(40, 512, fmt, 2)  # 3 row groups (the last padded), 2 superblocks
    packed = ql.pack_gguf_blocks(raw, fmt, 512)
    # per 16 rows and 256 values: 8 blocks of qs and one scale record, against 16 GGUF
    # superblocks: Q4_K 2048 + 256 = 2304 bytes, Q6_K 3072 + 288 = 3360, as in the GGUF
    qs_bytes = {ql.Q4_K: 256, ql.Q6_K: 384}[fmt]
    assert packed.nbytes == 3 * 2 * (8 * qs_bytes + ql._K_SCALE_BYTES[fmt])
    assert packed.nbytes == 48 * raw.shape[1]


@pytest.mark.parametrize("fmt", [ql.Q4_0, ql.Q4_1, ql.Q8_0, ql.Q4_K, ql.Q6_K])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 21])
def test_row_tails_bias_and_partial_row_groups(ops, fmt, rows):
    n, k = 40, 128 if fmt not in ql.K_QUANTS else 256  # 2.5 row groups: the last padded
    packed = ql.pack_gguf_blocks(random_blocks(n, k, fmt, rows), fmt, k)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    check_all_routes(ops, x, packed, bias)


def test_routes_built_and_the_default_is_the_fastest_built(ops):
    routes = ql.routes_available()
    assert ql.SCALAR in routes and ql.WIDEN in routes
    flags = cpu_extension.cpu_flags().split()
    assert (ql.VNNI512 in routes) == ({"avx512_vnni", "avx512bw"} <= set(flags))
    assert (ql.AVX2 in routes) == ("avx2" in flags)
    assert (ql.BF16DOT in routes) == ({"avx512_bf16", "avx512bw"} <= set(flags))
    # Linux grants the tile state on request (5.16 on); a kernel that refuses it means
    # AMX is not usable here although the CPU has it
    assert (ql.AMX in routes) == ({"avx512_bf16", "avx512bw", "amx_tile", "amx_bf16"}
                                  <= set(flags))
    packed = ql.pack_gguf_blocks(random_blocks(32, 64, ql.Q4_1, 0), ql.Q4_1, 64)
    x = torch.randn(5, 64)
    best = ops.quant_linear(x, packed.qs, packed.scales, ql.Q4_1, 32, None, ql.BEST_INT8)
    assert torch.equal(best, ops.quant_linear(x, packed.qs, packed.scales, ql.Q4_1, 32,
                                              None, routes[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_round_the_output_once(ops, dtype):
    packed = ql.pack_gguf_blocks(random_blocks(48, 64, ql.Q8_0, 3), ql.Q8_0, 64)
    x = torch.randn(6, 64).to(dtype)
    out = ql.quant_linear(x.view(2, 3, 64), packed)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    exact = ql.reference(x, packed)
    assert ((out.reshape(6, 48).double() - exact).abs()
            <= torch.finfo(dtype).eps * exact.abs() + 1e-4).all()


@pytest.mark.parametrize("route", [ql.BF16DOT, ql.AMX])
@pytest.mark.parametrize("fmt", [ql.Q4_0, ql.Q4_1, ql.Q4_K, ql.Q8_0, ql.Q6_K])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 21, 32, 40])
def test_bf16_route_on_bf16_activations(ops, fmt, rows, route):
    """The bf16 routes (vdpbf16ps, or AMX tiles, on 4-bit weights as 128 + u; the other
    formats widen) against the float64 product: the output's one bf16 rounding plus
    float32 sums whose terms are up to (128 + 15 + 8) / |u - offset| larger than the
    widening route's (the offset comes off per block), bounded here by 64x its float32
    bound. Row counts cover whole and partial AMX tiles of 16 rows."""
    if route not in ql.routes_available():
        pytest.skip(f"route {route} is not built here")
    n, k = 40, 512  # 2.5 row groups: the last padded
    packed = ql.pack_gguf_blocks(random_blocks(n, k, fmt, rows), fmt, k)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g).to(torch.bfloat16), torch.randn(n, generator=g)
    w, w_abs = dequantised_weights(packed)
    exact = ql.reference(x, packed, bias, route, w)
    within = (torch.finfo(torch.bfloat16).eps * exact.abs()
              + 64 * float32_error(x, packed, w_abs))
    check_route(ops, x, packed, route, exact, within, bias)
    # and it is the widening route's function: the two differ by output rounding only
    widen = ops.quant_linear(x, packed.qs, packed.scales, fmt, n, bias, ql.WIDEN).double()
    assert ((widen - exact).abs() <= within).all()


def test_rows_of_a_batch_do_not_change_each_other(ops):
    packed = ql.pack_gguf_blocks(random_blocks(64, 256, ql.Q4_1, 9), ql.Q4_1, 256)
    x = torch.randn(19, 256)
    together = ql.quant_linear(x, packed)
    alone = torch.cat([ql.quant_linear(x[i:i + 1], packed) for i in range(19)])
    assert torch.equal(together, alone)  # batch-invariant: same sums in the same order


@pytest.mark.parametrize("fmt", [ql.Q4_1, ql.Q6_K])
def test_amx_rows_do_not_change_each_other(ops, fmt):
    """An AMX tile sums each output in an order of the hardware's, but the same order
    whatever the other 15 rows of the tile hold."""
    if ql.AMX not in ql.routes_available():
        pytest.skip("no AMX-BF16 here")
    k = 512
    packed = ql.pack_gguf_blocks(random_blocks(64, k, fmt, 9), fmt, k)
    x = torch.randn(35, k).to(torch.bfloat16)
    together = ql.quant_linear(x, packed, route=ql.AMX)
    alone = torch.cat([ql.quant_linear(x[i:i + 1], packed, route=ql.AMX) for i in range(35)])
    assert torch.equal(together, alone)


def test_int8_per_channel_rounds_each_weight_by_at_most_half_a_step():
    w = torch.randn(40, 96) * torch.linspace(0.1, 3, 40)[:, None]
    packed = ql.int8_per_channel(w)
    assert packed.fmt == ql.Q8_0 and packed.shape == (40, 96)
    step = packed.scales[:, :, :16].float().permute(0, 2, 1).reshape(-1, 3)[:40, :1]
    assert ((ql.dequantize(packed) - w).abs() <= step / 2 + 1e-6).all()


def test_bad_operands_are_refused(ops):
    p = ql.pack_gguf_blocks(random_blocks(32, 64, ql.Q4_1, 1), ql.Q4_1, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="format"):
        ops.quant_linear(x, p.qs, p.scales, 7, 32, None, 0)
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        ops.quant_linear(torch.randn(2, 96), p.qs, p.scales, ql.Q4_1, 32, None, 0)
    with pytest.raises(RuntimeError, match="groups"):
        ops.quant_linear(x, p.qs, p.scales, ql.Q4_1, 33, None, 0)
    with pytest.raises(RuntimeError, match="route"):
        ops.quant_linear(x, p.qs, p.scales, ql.Q4_1, 32, None, 9)
    k = ql.pack_gguf_blocks(random_blocks(32, 256, ql.Q4_K, 1), ql.Q4_K, 256)
    with pytest.raises(RuntimeError, match="K-quant scales"):  # a Q4_1's scales
        ops.quant_linear(torch.randn(2, 256), k.qs, k.scales.view(torch.float16), ql.Q4_K,
                         32, None, 0)
    with pytest.raises(ValueError, match="superblocks"):
        ql.pack_gguf_blocks(random_blocks(32, 256, ql.Q6_K, 1), ql.Q6_K, 128)


@pytest.mark.parametrize("fmt", [ql.Q4_K, ql.Q6_K])
@pytest.mark.parametrize("n", [16, 40])
def test_k_quant_packing_keeps_gguf_values_bit_for_bit(fmt, n):
    raw = random_blocks(n, 512, fmt, n)
    expected = torch.from_numpy(gguf_dequantize(raw.numpy(), GGML[fmt]))
    packed = ql.pack_gguf_blocks(raw, fmt, 512)
    assert torch.equal(ql.dequantize(packed), expected)
    rows = torch.tensor([n - 1, 0, 17 % n, 5])
    assert torch.equal(ql.dequantize(packed, rows), expected[rows])


@pytest.mark.parametrize("fmt", [ql.Q4_0, ql.Q4_1, ql.Q8_0, ql.Q4_K, ql.Q6_K])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dequantize_equals_the_reference(ops, fmt, dtype):
    k = 256 if fmt in ql.K_QUANTS else 96
    packed = ql.pack_gguf_blocks(random_blocks(40, k, fmt, 5), fmt, k)
    expected = ql.dequantize(packed).to(dtype)
    assert torch.equal(ql.weight_rows(packed, None, dtype), expected)
    rows = torch.tensor([[39, 0], [16, 17]])
    assert torch.equal(ql.weight_rows(packed, rows, dtype), expected[rows.view(-1)])
    with pytest.raises(RuntimeError, match="out of range"):
        ql.weight_rows(packed, torch.tensor([40]))


@pytest.mark.parametrize("fmt", [ql.Q4_0, ql.Q4_1, ql.Q8_0, ql.Q4_K, ql.Q6_K])
def test_packing_in_row_chunks_changes_nothing(fmt, monkeypatch):
    k = 256
    raw = random_blocks(70, k, fmt, 4)  # chunks of 32, 32 and 6 rows (the last padded)
    whole = ql.pack_gguf_blocks(raw, fmt, k)
    monkeypatch.setattr(ql, "PACK_ROWS", 32)
    chunked = ql.pack_gguf_blocks(raw, fmt, k)
    assert torch.equal(chunked.qs, whole.qs) and torch.equal(chunked.scales, whole.scales)
    assert chunked.n == 70 and chunked.k == k


@pytest.mark.parametrize("fmt", [ql.Q4_0, ql.Q4_1, ql.Q4_K, ql.Q8_0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int16_route_at_its_largest_sums(ops, fmt, sign):
    """Every stored value at its largest (4-bit 15, Q8_0's 255) against activations all
    at a block's largest (32767 each): the route's biggest integer sums (the 256-scaled
    pairs of a Q4 block reach 4 x 2 x 3840 x 32767, under 2^31) stay exact."""
    if ql.INT16 not in ql.routes_available():
        pytest.skip("the int16 route needs AVX2")
    n, k = 32, 512
    raw = random_blocks(n, k, fmt, 5)
    if fmt in ql.K_QUANTS:
        blocks = raw.view(n, k // 256, -1)
        blocks[..., 4:16] = 0x3F  # every 6-bit scale and min at its largest
        blocks[..., 16:] = 0xFF
    else:
        blocks = raw.view(n, k // 32, -1)
        blocks[..., (4 if fmt == ql.Q4_1 else 2):] = 0xFF
    packed = ql.pack_gguf_blocks(raw, fmt, k)
    x = torch.full((3, k), sign)
    x[1, ::7] = -2 * sign  # and blocks whose largest is another value
    w, w_abs = dequantised_weights(packed)
    exact = ql.reference(x, packed, None, ql.INT16, w)
    check_route(ops, x, packed, ql.INT16, exact, float32_error(x, packed, w_abs))


def test_int16_route_rounds_activations_to_one_part_in_65534(ops):
    """Far finer than int8: on spread-out activations the int16 route stays within its
    bound of the dequantised product, and 200x closer to it than the int8 route."""
    if ql.INT16 not in ql.routes_available():
        pytest.skip("the int16 route needs AVX2")
    n, k = 96, 576
    packed = ql.pack_gguf_blocks(random_blocks(n, k, ql.Q4_1, 8), ql.Q4_1, k)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, k, generator=g) * torch.logspace(-3, 2, k)[torch.randperm(k, generator=g)]
    w, w_abs = dequantised_weights(packed)
    exact = x.double() @ w.t()
    int16 = ql.quant_linear(x, packed, route=ql.INT16).double()
    int8 = ql.quant_linear(x, packed, route=ql.BEST_INT8).double()
    bound = ql.activation_rounding_bound(x, packed, w_abs, 32767) + float32_error(x, packed, w_abs)
    assert ((int16 - exact).abs() <= bound).all()
    assert (int16 - exact).norm() * 100 < (int8 - exact).norm()  # measured 190x
