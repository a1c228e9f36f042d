"""The native CPU SwiGLU activation and RoPE against their torch references, bit for bit.

``torch.ops.folio.silu_and_mul`` must give torch's ``F.silu(gate) * up`` exactly (the
same SLEEF exponential on whole vector pairs, std::exp on a row's tail), and
``torch.ops.folio.rotary_embedding`` the reference's products and sums with the same
roundings. Shapes include rows whose length leaves a tail, specials (inf, NaN, large
magnitudes) and the strided q/k views a fused qkv projection gives.
``FOLIO_DISABLE_CPU_KERNELS=1`` skips.
"""
import os

import pytest
import torch

from kernels import cpu_extension
from kernels.rotary_embedding import rotary_embedding, rotary_embedding_reference
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference
from worker.models.rotary_embedding import RotaryEmbedding

if os.environ.get(cpu_extension.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpu_extension.DISABLE_ENV} is set", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_extension.is_available(), cpu_extension.unavailable_reason()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (a NaN's payload may differ)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (37, 17), (5, 65), (3, 100), (48, 1536),
                                        (2, 5632), (0, 64)])
def test_silu_and_mul_is_torchs_two_ops(rows, inter, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)
    if rows:
        specials = torch.tensor([float("inf"), -float("inf"), float("nan"), -100.0, 100.0])
        gate_up[0, :min(5, inter)] = specials[:min(5, inter)].to(dtype)
    out = cpu_extension.require().silu_and_mul(gate_up)
    assert same_bits(out, silu_and_mul_reference(gate_up))


def test_silu_and_mul_takes_strided_rows_and_falls_back_for_others():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 300, generator=gen).bfloat16()
    gate_up = wide[:, :256]  # rows 300 apart
    assert same_bits(silu_and_mul(gate_up), silu_and_mul_reference(gate_up))
    three_d = torch.randn(2, 3, 8, generator=gen)  # not the native kernel's shape
    assert same_bits(silu_and_mul(three_d), silu_and_mul_reference(three_d))
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        cpu_extension.require().silu_and_mul(torch.randn(4, 7))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim",
                         [(1, 9, 3, 64), (37, 9, 3, 64), (300, 32, 4, 128), (5, 2, 1, 10)])
def test_rotary_embedding_is_the_reference(tokens, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(tokens + heads)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim)  # strided views
    angles = rotary(torch.randint(0, 4096, (tokens,), generator=gen), dtype)
    ref_q, ref_k = rotary_embedding_reference(q, k, angles.cos, angles.sin)
    out_q, out_k = cpu_extension.require().rotary_embedding(q, k, angles.cos, angles.sin)
    assert same_bits(out_q, ref_q) and same_bits(out_k, ref_k)
    disp_q, disp_k = rotary_embedding(q, k, angles.cos, angles.sin)  # the dispatcher
    assert same_bits(disp_q, ref_q) and same_bits(disp_k, ref_k)


def test_rotary_embedding_refuses_what_it_cannot_read():
    ops = cpu_extension.require()
    rotary = RotaryEmbedding(8, 16, 10000.0)
    angles = rotary(torch.arange(4), torch.float32)
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rotary_embedding(q.bfloat16(), k.bfloat16(), angles.cos, angles.sin)
    with pytest.raises(RuntimeError, match="heads contiguous"):
        ops.rotary_embedding(q.transpose(0, 1), k, angles.cos, angles.sin)
    # the dispatcher never hands it such operands: the reference runs instead
    q_t = torch.randn(2, 4, 8).transpose(0, 1)
    out_q, _ = rotary_embedding(q_t, k, angles.cos, angles.sin)
    assert same_bits(out_q, rotary_embedding_reference(q_t, k, angles.cos, angles.sin)[0])
