"""The native 16-bit linear kernel (``torch.ops.folio.half_linear``) against float64.

The kernel computes ``x @ weight.T (+ bias)`` in float32 from 16-bit weights and rounds
the result once to x's dtype. With float32 x the reference is the float64 product of
the same (exactly representable) values, so the only difference is float32 summation
order. ``FOLIO_DISABLE_CPU_KERNELS=1`` skips.
"""
import os

import pytest
import torch

from kernels import cpu_extension

if os.environ.get(cpu_extension.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpu_extension.DISABLE_ENV} is set", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    assert cpu_extension.is_available(), cpu_extension.unavailable_reason()
    return cpu_extension.require()


def reference(x, w, b=None):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def assert_float32_close(out, exact, k):
    # float32 sums of k products: error well under k * eps32 of the absolute sum
    assert out.dtype == torch.float32 and out.shape == exact.shape
    if exact.numel() == 0:
        return
    bound = 4 * k * torch.finfo(torch.float32).eps * exact.abs().max().clamp_min(1.0)
    assert (out.double() - exact).abs().max() <= bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 255])
def test_every_row_tiling_matches_the_reference(ops, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype).float()  # float32 out: no rounding
    w = torch.randn(48, 96, generator=g).to(dtype)
    out = ops.half_linear(x, w)
    assert out.shape == (rows, 48)
    assert_float32_close(out, reference(x, w), 96)


@pytest.mark.parametrize("k,n", [(32, 16), (576, 960), (1536, 576), (64, 4096)])
def test_model_shapes_with_bias_and_float32_input(ops, k, n):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(9, k, generator=g)  # float32 activations are accepted as they are
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    assert_float32_close(ops.half_linear(x, w, b), reference(x, w, b), k)


def test_strided_operands(ops):
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(32, 200, generator=g).bfloat16()
    w = wide[:, 8:72]                      # rows 200 apart, each contiguous
    x = torch.randn(64, 5, generator=g).bfloat16().float().t()   # non-contiguous [5, 64]
    assert_float32_close(ops.half_linear(x, w), reference(x, w), 64)
    rows = torch.randn(6, 100, generator=g).bfloat16().float()[:, 4:68]  # rows 100 apart
    assert_float32_close(ops.half_linear(rows, w), reference(rows, w), 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_input_gives_16_bit_output_rounded_once(ops, dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(10, 64, generator=g).to(dtype)
    w = torch.randn(32, 64, generator=g).to(dtype)
    b = torch.randn(32, generator=g).to(dtype)
    out = ops.half_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (10, 32)
    exact = reference(x, w, b)
    # the float32 sum, rounded once: within one 16-bit ulp of the exact value
    ulp = torch.finfo(dtype).eps * exact.abs()
    assert ((out.double() - exact).abs() <= ulp + 1e-3).all()


def test_distinct_rows_and_columns_land_in_place(ops):
    # one-hot rows pick single weight columns: any permutation slip shows exactly
    k, n = 64, 32
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).remainder(251).bfloat16()
    x = torch.eye(k)[[0, 5, 17, 31, 32, 47, 63]]
    out = ops.half_linear(x, w)
    assert torch.equal(out, w.float().t()[[0, 5, 17, 31, 32, 47, 63]])


def test_bad_shapes_are_refused(ops):
    x = torch.zeros(2, 40, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.half_linear(x, torch.zeros(16, 40, dtype=torch.bfloat16))   # K % 32
    with pytest.raises(RuntimeError, match="multiple"):
        ops.half_linear(x[:, :32], torch.zeros(8, 32, dtype=torch.bfloat16))  # N % 16
    with pytest.raises(RuntimeError, match="weight"):
        ops.half_linear(x[:, :32], torch.zeros(16, 32))                 # float32 weight
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.half_linear(x[:, :32], torch.zeros(32, 16, dtype=torch.bfloat16).t())
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        ops.half_linear(x[:, :32], torch.zeros(16, 64, dtype=torch.bfloat16))
