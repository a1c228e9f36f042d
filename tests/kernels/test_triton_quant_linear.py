"""The Triton dequant-GEMM on packed Q4_0/Q4_1/Q8_0 weights against the torch reference
``x @ dequantize(W).T``. Interpreted on the CPU (TRITON_INTERPRET=1 from
tests/conftest.py), compiled on a GPU.

Tolerance: in float32 the kernel differs from the float64 reference by float32 rounding
of a K-term sum, at most ``(K + 4) * eps32 * (|x| @ |W|.T)``. With 16-bit x the weight
is rounded to x's dtype before the product and the output rounds once more: a few units
of the 16-bit rounding of ``|x| @ |W|.T`` (the interpreter truncates bf16, hence 2^-6).
A wrong byte, nibble or scale moves outputs by the size of ``|x| @ |W|.T`` itself.
"""
import pytest
import torch

from kernels import quant_linear as ql
from kernels.triton_quant_linear import quant_linear_triton
from tests.kernels.ragged_case import DEVICE

EPS32 = torch.finfo(torch.float32).eps
BLOCK_BYTES = {ql.Q4_0: 18, ql.Q4_1: 20, ql.Q8_0: 34}


def random_packed(n: int, k: int, fmt: int, seed: int) -> ql.PackedWeight:
    """Random GGUF blocks (random quants, plausible fp16 scales), packed."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[fmt]), generator=gen,
                           dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, 2, generator=gen) * 0.02 + 1e-3).half()
    if fmt == ql.Q4_1:
        scales[..., 1] = -8 * scales[..., 0]
    count = 2 if fmt == ql.Q4_1 else 1
    blocks[..., :2 * count] = scales[..., :count].contiguous().view(torch.uint8)
    return ql.pack_gguf_blocks(blocks.reshape(n, -1), fmt, k)


def on_device(p: ql.PackedWeight) -> ql.PackedWeight:
    return ql.PackedWeight(p.fmt, p.n, p.k, p.qs.to(DEVICE), p.scales.to(DEVICE))


def check(x, p, bias, dtype):
    w = ql.dequantize(p).double()
    ref = x.double() @ w.t() + (0 if bias is None else bias.double())
    out = quant_linear_triton(x.to(DEVICE, dtype), on_device(p),
                              None if bias is None else bias.to(DEVICE, dtype))
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], p.n)
    scale = x.double().abs() @ w.abs().t()
    bound = ((p.k + 4) * EPS32 if dtype == torch.float32 else 2 ** -6) * scale + 1e-6
    if bias is not None:
        bound = bound + bias.double().abs() * (EPS32 if dtype == torch.float32 else 2 ** -7)
    err = (out.cpu().double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("fmt", [ql.Q4_0, ql.Q4_1, ql.Q8_0], ids=["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (200, 256), (96, 576)])
@pytest.mark.parametrize("m", [1, 33])  # 12 rows: the 16-bit test below
def test_matches_the_dequantised_product_in_float32(fmt, n, k, m):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * n + k))
    check(x, random_packed(n, k, fmt, seed=n + k), None, torch.float32)


@pytest.mark.parametrize("fmt", [ql.Q4_1, ql.Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16_bit_activations_and_bias(fmt, dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 64, generator=gen).to(dtype).float()  # leading dims kept
    bias = torch.randn(48, generator=gen).to(dtype).float()
    check(x, random_packed(48, 64, fmt, seed=3), bias, dtype)


def test_a_wrong_weight_is_caught():
    # the bound above must be tight enough to see one quant step in one row
    p = random_packed(40, 96, ql.Q8_0, seed=1)
    wrong = ql.PackedWeight(p.fmt, p.n, p.k, p.qs.clone(), p.scales)
    wrong.qs[1, 0, 4 * 3] ^= 1  # row 16 + 3, k = 0 of block 0
    x = torch.ones(2, 96)
    w = ql.dequantize(p).double()
    out = quant_linear_triton(x.to(DEVICE), on_device(wrong)).cpu().double()
    bound = (p.k + 4) * EPS32 * (x.double().abs() @ w.abs().t()) + 1e-6
    err = (out - x.double() @ w.t()).abs()
    assert (err > bound).nonzero().tolist() == [[0, 19], [1, 19]]
