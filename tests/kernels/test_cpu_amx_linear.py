"""The bf16 AMX tile linear kernel (``torch.ops.folio.amx_linear``) against float64.

The kernel computes ``x @ weight.T (+ bias)`` from bf16 operands with float32 products
and sums, and rounds each output once to bf16. The reference is the float64 product of
the same values, so an output may differ by the bf16 rounding plus float32 summation
error. The module skips where the kernel is not built (no AMX-BF16) or the CPU kernels
are switched off.
"""
import os

import pytest
import torch

from kernels import cpu_extension
from worker import linear_backend
from worker.models.linear_paths import (AMX, AMX_LINEAR_MAX_ROWS, ROW_BUCKETS,
                                        amx_linear_takes, candidates, run_path)

if os.environ.get(cpu_extension.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpu_extension.DISABLE_ENV} is set", allow_module_level=True)
if not (cpu_extension.is_available() and cpu_extension.require().amx_linear_available()):
    pytest.skip("the AMX tile linear kernel is not built here (no AMX-BF16)",
                allow_module_level=True)

ops = cpu_extension.require()


def assert_close_to_reference(out, x, w, b=None):
    exact = x.double() @ w.double().t()
    if b is not None:
        exact = exact + b.double()
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    if exact.numel() == 0:
        return
    k = x.shape[1]
    # one bf16 rounding (half an ulp: 2^-9 relative) plus float32 sums of k products
    sums = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())
    bound = exact.abs() * 2.0 ** -8 + sums + 1e-30
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [0, 1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 130, 257])
def test_every_row_tiling_matches_the_reference(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(48, 96, generator=g).bfloat16()
    out = ops.amx_linear(x, w)
    assert out.shape == (rows, 48)
    assert_close_to_reference(out, x, w)


@pytest.mark.parametrize("rows", [33, 48, 64, 65, 70, 130])
def test_long_k_runs_one_group_a_pass_at_many_rows(rows):
    # k >= 2048 and more than 32 rows: group_product, its A tile double-buffered (odd
    # and even numbers of k steps), the last row chunk of 1 to 4 tiles
    g = torch.Generator().manual_seed(rows)
    for k in (2048, 2080):
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = (torch.randn(48, k, generator=g) * 0.05).bfloat16()
        b = torch.randn(48, generator=g)
        assert_close_to_reference(ops.amx_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("k,n", [(32, 16), (576, 960), (1536, 576), (64, 4096), (5632, 32)])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_model_shapes_with_bias(k, n, bias_dtype):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(37, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).to(bias_dtype)
    assert_close_to_reference(ops.amx_linear(x, w, b), x, w, b)


def test_results_do_not_depend_on_threads_or_the_other_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 576, generator=g).bfloat16()
    w = torch.randn(960, 576, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.amx_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ops.amx_linear(x, w), one)
    assert torch.equal(ops.amx_linear(x[5:6], w), one[5:6])  # a row alone: same bits


def test_strided_activations_and_the_path_wrapper():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 128, generator=g).bfloat16()
    w = torch.randn(32, 64, generator=g).bfloat16()
    strided = x[..., ::2]
    assert AMX in candidates(w, lossy=False, dtype=torch.bfloat16)
    out = run_path(AMX, strided, w, None)
    assert out.shape == (2, 3, 32)
    assert_close_to_reference(out.reshape(6, 32), strided.reshape(6, 64), w)


def test_which_weights_it_takes():
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert amx_linear_takes(w, torch.bfloat16) and amx_linear_takes(w, None)
    assert not amx_linear_takes(w, torch.float32)
    assert not amx_linear_takes(w.half(), torch.float16)
    assert not amx_linear_takes(torch.zeros(24, 64, dtype=torch.bfloat16), None)  # n % 16
    assert not amx_linear_takes(torch.zeros(32, 48, dtype=torch.bfloat16), None)  # k % 32
    assert not amx_linear_takes(torch.zeros(64, 32, dtype=torch.bfloat16).t(), None)


def test_the_measured_choice_times_it_for_decode_rows_only(monkeypatch):
    timed = []

    def fake_pass(path, x, weights):  # equal times: no path is given up as too slow
        timed.append((path, x.shape[0]))
        return 1.0

    monkeypatch.setattr(linear_backend, "_pass_seconds", fake_pass)
    ws = [torch.randn(32, 64).bfloat16() for _ in range(2)]
    out = linear_backend.time_paths(ws, ("native", AMX), torch.bfloat16)
    for rows, seconds in zip(ROW_BUCKETS, out[AMX]):
        assert (seconds is None) == (rows > AMX_LINEAR_MAX_ROWS)
    assert {rows for path, rows in timed if path == AMX} == {
        r for r in ROW_BUCKETS if r <= AMX_LINEAR_MAX_ROWS}
    assert {rows for path, rows in timed if path == "native"} == set(ROW_BUCKETS)


def test_bad_operands_are_refused():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 x and weight"):
        ops.amx_linear(x, w.half())
    with pytest.raises(RuntimeError, match="bf16 x and weight"):
        ops.amx_linear(x.float(), w)
    with pytest.raises(RuntimeError, match=r"x is \[M, K\]"):
        ops.amx_linear(torch.zeros(4, 32, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.amx_linear(torch.zeros(4, 48, dtype=torch.bfloat16),
                       torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.amx_linear(torch.zeros(4, 32, dtype=torch.bfloat16),
                       torch.zeros(32, 64, dtype=torch.bfloat16)[:, ::2])
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.amx_linear(x, w, torch.zeros(16))
    with pytest.raises(RuntimeError, match="2-D"):
        ops.amx_linear(x[None], w)
