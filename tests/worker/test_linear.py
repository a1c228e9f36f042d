"""The widening linear path computes what the native 16-bit GEMM computes."""
import pytest
import torch
import torch.nn.functional as F

from worker.device import cpu_has_native_half
from worker.models.linear import (PACK_ROWS, WIDEN_MIN_ROWS, Linear, can_pack, linear,
                                  needs_widening)


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


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="needs torch with MKL")
@pytest.mark.parametrize("rows", [1, 7, PACK_ROWS, 200, 700])
def test_packed_linear_equals_f_linear_for_any_row_count(rows):
    g = torch.Generator().manual_seed(rows)
    layer = Linear(96, 80, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=g))
        layer.bias.copy_(torch.randn(80, generator=g))
    assert layer.pack()
    x = torch.randn(rows, 96, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-4)
    layer.packed_weight = None  # the unpacked path agrees as well
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_pack_refuses_weights_it_cannot_pack():
    layer = Linear(8, 8).to(torch.bfloat16)
    assert not layer.pack() and layer.packed_weight is None
