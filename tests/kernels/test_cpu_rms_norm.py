"""The native CPU fused RMSNorm (``torch.ops.folio.rms_norm``) against the reference.

Same contract as ``rms_norm_reference``: the residual sum rounded to the activation
dtype (bit for bit), statistics in float32, the normalised value rounded before the
weight multiplies it. Only the float32 summation order of the statistics differs.
``FOLIO_DISABLE_CPU_KERNELS=1`` skips.
"""
import os

import pytest
import torch

from kernels import cpu_extension
from kernels.rms_norm import rms_norm, rms_norm_cpu, rms_norm_reference

if os.environ.get(cpu_extension.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpu_extension.DISABLE_ENV} is set", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the statistics' summation order can move a 16-bit output by one rounding
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_extension.is_available(), cpu_extension.unavailable_reason()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (40, 100), (0, 32)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_native_rms_norm_matches_the_reference(rows, hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(hidden + rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    ref = rms_norm_reference(x, weight, 1e-5, residual)
    out = rms_norm_cpu(x, weight, 1e-5, residual)
    if with_residual:
        (out, new_res), (ref, ref_res) = out, ref
        assert torch.equal(new_res, ref_res)  # the rounded sum, bit for bit
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_strided_rows_and_the_dispatcher():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 200, generator=gen).bfloat16()
    x = wide[:, 10:138]  # rows 200 apart
    residual = torch.randn(6, 128, generator=gen).bfloat16()
    weight = torch.rand(128, generator=gen).bfloat16()
    out, new_res = rms_norm(x, weight, 1e-6, residual)  # takes the native kernel
    ref, ref_res = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)
    assert torch.equal(x, wide[:, 10:138])  # inputs untouched


def test_bad_shapes_are_refused():
    ops = cpu_extension.require()
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(9), 1e-6, None)
    with pytest.raises(RuntimeError, match="residual"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(8), 1e-6, torch.zeros(3, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_vector_roundings_match_torch_at_ties_and_special_values(dtype):
    """Whole vectors of a row round in SIMD code, the tail one by one: both must give
    torch's bits, ties to even, infinities and NaN included (hidden 35: two vectors of
    16 and a tail of 3 on AVX-512)."""
    info = torch.finfo(dtype)
    ulp = 2.0 ** -(info.bits - 1 - (8 if dtype == torch.bfloat16 else 5))  # at 1.0
    x = torch.ones(4, 35, dtype=torch.float32)
    residual = torch.zeros(4, 35)
    residual[0] = ulp / 2  # exact ties: 1 + ulp/2 goes down to even, 1 + 3ulp/2 up
    residual[1] = 3 * ulp / 2 * torch.ones(35)
    residual[2, ::2] = -ulp / 4
    residual[3, 5], residual[3, 20], residual[3, 33] = float("inf"), float("nan"), info.max
    x, residual = x.to(dtype), residual.to(dtype)
    weight = torch.linspace(0.5, 2, 35).to(dtype)
    out, new_res = rms_norm_cpu(x, weight, 1e-6, residual)
    ref, ref_res = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(new_res.view(torch.int16)[:3], ref_res.view(torch.int16)[:3])
    assert torch.equal(new_res[3].isnan(), ref_res[3].isnan())
    assert torch.equal(new_res[3].nan_to_num(), ref_res[3].nan_to_num())
    torch.testing.assert_close(out[:3].float(), ref[:3].float(), atol=TOL[dtype], rtol=TOL[dtype])
