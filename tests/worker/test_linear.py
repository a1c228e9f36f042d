"""The widening linear path computes what the native 16-bit GEMM computes."""
import pytest
import torch
import torch.nn.functional as F

from worker.device import cpu_has_native_half
from worker.models.linear import (WIDEN_MIN_ROWS, Linear, is_k_major, linear, needs_widening,
                                  use_k_major_weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 200])
def test_linear_matches_a_float32_reference_within_one_rounding(dtype, rows):
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


def test_widening_applies_only_to_many_16_bit_rows_on_a_cpu_without_half_arithmetic():
    big = torch.zeros(WIDEN_MIN_ROWS, 8, dtype=torch.bfloat16)
    assert needs_widening(big) == (not cpu_has_native_half(torch.bfloat16))
    assert not needs_widening(big[:WIDEN_MIN_ROWS - 1])
    assert not needs_widening(big.float())


def test_linear_module_keeps_nn_linear_parameter_names():
    layer = Linear(4, 3, bias=True)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_major_weights_keep_values_shapes_and_results(dtype):
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(Linear(96, 80), Linear(80, 40, bias=False)).to(dtype)
    x = torch.randn(70, 96, generator=g).to(dtype)
    before = model(x)
    weights = [m.weight.detach().clone() for m in model]
    assert use_k_major_weights(model) == 2
    for m, w in zip(model, weights):
        assert is_k_major(m.weight) and not m.weight.is_contiguous()
        assert m.weight.shape == w.shape and torch.equal(m.weight, w)
        assert isinstance(m.weight, torch.nn.Parameter)
    torch.testing.assert_close(model(x), before)
    with torch.no_grad():  # loading into a re-laid weight keeps its layout
        model[0].weight.copy_(weights[0] * 2)
    assert is_k_major(model[0].weight)
