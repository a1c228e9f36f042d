"""Every 16-bit linear path (native, kernel, widening) computes the same product."""
import pytest
import torch
import torch.nn.functional as F

from worker.device import cpu_has_native_half
from kernels import cpu_extension
from worker.models.linear import (HALF_KERNEL_MAX_ROWS, KERNEL, NATIVE, WIDEN, WIDEN_MIN_ROWS,
                                  Linear, half_path, is_k_major, k_major, linear,
                                  use_k_major_weights, wants_k_major)

NO_HALF = not cpu_has_native_half(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 200,
                                  HALF_KERNEL_MAX_ROWS + 3])
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_linear_matches_a_float32_reference_within_one_rounding(dtype, rows, kernels,
                                                                monkeypatch):
    if kernels == "off":
        monkeypatch.setenv(cpu_extension.DISABLE_ENV, "1")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(80, 96, generator=g).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    out = linear(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, 80)
    exact = F.linear(x.double(), w.double(), b.double())
    # one rounding to the 16-bit type on output (products and sums are float32)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(out.double(), exact, rtol=2 * eps, atol=1e-3 * exact.abs().max())


def test_half_path_picks_the_kernel_below_its_row_limit_and_widens_above():
    w = torch.zeros(80, 96, dtype=torch.bfloat16)
    x = torch.zeros(HALF_KERNEL_MAX_ROWS, 96, dtype=torch.bfloat16)
    assert half_path(x.float(), w.float()) == NATIVE
    if not NO_HALF:
        assert half_path(x, w) == NATIVE
        return
    assert cpu_extension.is_available(), cpu_extension.unavailable_reason()
    assert half_path(x, w) == WIDEN
    assert half_path(x[:HALF_KERNEL_MAX_ROWS - 1], w) == KERNEL
    assert half_path(x[:1], w) == KERNEL
    assert half_path(x[:7].view(1, 7, 96), w) == KERNEL  # rows count across leading dims
    # weights the kernel cannot read: K-major, or in/out not multiples of 32/16
    for odd in (k_major(w), torch.zeros(80, 40, dtype=torch.bfloat16)):
        xs = torch.zeros(WIDEN_MIN_ROWS, odd.shape[1], dtype=torch.bfloat16)
        assert half_path(xs, odd) == WIDEN
        assert half_path(xs[:WIDEN_MIN_ROWS - 1], odd) == NATIVE


def test_without_the_kernels_16_bit_rows_widen_from_the_widening_threshold(monkeypatch):
    monkeypatch.setenv(cpu_extension.DISABLE_ENV, "1")
    w = torch.zeros(80, 96, dtype=torch.bfloat16)
    x = torch.zeros(WIDEN_MIN_ROWS, 96, dtype=torch.bfloat16)
    assert half_path(x, w) == (WIDEN if NO_HALF else NATIVE)
    assert half_path(x[:WIDEN_MIN_ROWS - 1], w) == NATIVE
    assert wants_k_major(torch.bfloat16)


def test_kernel_path_keeps_leading_dims_and_matches_the_widened_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    out = linear(x, w)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    widened = F.linear(x.float(), w.float()).bfloat16()
    torch.testing.assert_close(out, widened, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=0)


def test_linear_module_keeps_nn_linear_parameter_names():
    layer = Linear(4, 3, bias=True)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_major_weights_keep_values_shapes_and_results(dtype):
    torch.manual_seed(3)  # the layers' initial weights
    model = torch.nn.Sequential(Linear(96, 80), Linear(80, 40, bias=False)).to(dtype)
    x = torch.randn(70, 96).to(dtype)
    before = model(x)
    weights = [m.weight.detach().clone() for m in model]
    assert use_k_major_weights(model) == 2
    for m, w in zip(model, weights):
        assert is_k_major(m.weight) and not m.weight.is_contiguous()
        assert m.weight.shape == w.shape and torch.equal(m.weight, w)
        assert isinstance(m.weight, torch.nn.Parameter)
    # In bf16 the re-laid first layer leaves the kernel for widening: the same float32
    # sums in another order, so an output may round one ulp apart, and the second layer
    # sees that: allow a few ulps of the output's scale.
    scale = before.abs().max().item()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(model(x), before, rtol=max(2 * eps, 1.3e-6),
                               atol=max(4 * eps * scale, 1e-5))
    with torch.no_grad():  # loading into a re-laid weight keeps its layout
        model[0].weight.copy_(weights[0] * 2)
    assert is_k_major(model[0].weight)


def test_16_bit_weights_stay_row_major_where_the_kernel_reads_them():
    # on any CPU, so that the measured choice (worker/linear_backend.py) can pick it
    assert wants_k_major(torch.float32)
    assert wants_k_major(torch.bfloat16) == (not cpu_extension.is_available())
