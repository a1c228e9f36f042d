"""reshape_and_cache, fused RMSNorm (+ residual) and rotary embedding: Triton vs reference.

Interpreted on the CPU (TRITON_INTERPRET=1 from tests/conftest.py), compiled on a GPU.
"""
import pytest
import torch

from kernels.reshape_and_cache import reshape_and_cache_reference
from kernels.rms_norm import rms_norm, rms_norm_reference
from kernels.rotary_embedding import rotary_embedding_reference
from kernels.triton_reshape_and_cache import reshape_and_cache_triton
from kernels.triton_rms_norm import rms_norm_triton
from kernels.triton_rotary_embedding import rotary_embedding_triton
from tests.kernels.ragged_case import DEVICE, INTERPRETING
from worker.models.rotary_embedding import RotaryEmbedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
# one rounding of the output dtype, relative, with a little slack
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("cache_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=["k32", "kbf16"])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(4, 2, 16), (16, 3, 64),
                                                              (8, 1, 48)])
def test_reshape_and_cache(block_size, num_kv_heads, head_dim, key_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 6, 13
    # keys as the model has them: a column slice of a wider fused projection
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(key_dtype)
    key = qkv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view_as(key)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens write nothing
    start = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    ref = start.to(cache_dtype, copy=True)
    reshape_and_cache_reference(key, value, ref, slots)
    cache = start.to(cache_dtype, copy=True).to(DEVICE)
    reshape_and_cache_triton(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE))
    if INTERPRETING and cache_dtype == torch.bfloat16 and key_dtype != cache_dtype:
        # the interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest even)
        torch.testing.assert_close(cache.cpu(), ref, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(cache.cpu(), ref)  # a copy with one conversion: bit-exact
    assert not torch.equal(ref, start.to(cache_dtype))  # the write did happen


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hidden", [64, 576, 100])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype) if with_residual else None
    ref = rms_norm_reference(x, weight, 1e-5, residual)
    dev = None if residual is None else residual.to(DEVICE)
    out = rms_norm_triton(x.to(DEVICE), weight.to(DEVICE), 1e-5, dev)
    if with_residual:
        (out, new_res), (ref, ref_res) = out, ref
        if INTERPRETING and dtype == torch.bfloat16:  # truncates instead of rounding
            torch.testing.assert_close(new_res.cpu(), ref_res, atol=0, rtol=2 ** -7)
        else:
            assert torch.equal(new_res.cpu(), ref_res)  # the rounded sum, bit for bit
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


def test_rms_norm_dispatch_on_cpu_with_mixed_dtypes_is_the_reference():
    # a float32 weight on bf16 activations promotes the output: only the reference does
    x, w = torch.randn(3, 8).bfloat16(), torch.rand(8)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32
    assert torch.equal(out, rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (9, 3, 64),
                                                             (6, 1, 48)])
def test_rotary_embedding(num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens = 11
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    angles = rotary(positions, dtype)
    # q and k as the model has them: strided views of the fused qkv output
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    ref_q, ref_k = rotary_embedding_reference(q, k, angles.cos, angles.sin)
    dev_qkv = qkv.to(DEVICE)
    out_q, out_k = rotary_embedding_triton(
        dev_qkv[:, :q_size].view_as(q), dev_qkv[:, q_size:q_size + kv_size].view_as(k),
        angles.cos.to(DEVICE), angles.sin.to(DEVICE))
    # the reference rounds after each product, the kernel once: a few ulps apart
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(out_q.cpu().float(), ref_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out_k.cpu().float(), ref_k.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv.to(DEVICE), dev_qkv)  # inputs untouched
