"""The native CPU decode kernel against the torch reference (``paged_attention_reference``).

The kernel must build here: if it cannot, these tests fail rather than skip, so a broken
toolchain is noticed. ``FOLIO_DISABLE_CPU_KERNELS=1`` skips them on purpose.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_paged_attention as cpa
from kernels.paged_attention import make_plan, paged_attention_reference

if os.environ.get(cpa.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpa.DISABLE_ENV} is set", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    assert cpa.is_available(), f"CPU kernel failed to build: {cpa.unavailable_reason()}"


def make_decode_batch(seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype,
                      seed=0, q_scale=1.0):
    """Random cache with each request's blocks scattered over shuffled block ids.

    Returns query [D, H, hd], kv_cache, block_tables [D, max_blocks] int64 (unused
    entries point at block 0, the reference's padding) and seq_lens int64.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(blocks_per_req), 1) + 1  # a spare column, as the runner has
    num_blocks = 1 + sum(blocks_per_req) + 2
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    used = 0
    for r, n in enumerate(blocks_per_req):
        tables[r, :n] = torch.tensor(perm[used:used + n], dtype=torch.int64)
        used += n
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen) * q_scale
    return (query.to(dtype), cache.to(dtype), tables,
            torch.tensor(seq_lens, dtype=torch.int64))


def reference(query, cache, tables, seq_lens, scale, window):
    block_size, num_kv_heads, head_dim = cache.shape[2:]
    n = query.shape[0]
    plan = make_plan(list(range(n + 1)), seq_lens.tolist(), tables, block_size, window)
    # all-decode batch: key/value are only read for prefills, any [T, kvh, hd] will do
    kv = torch.zeros(n, num_kv_heads, head_dim, dtype=query.dtype)
    return paged_attention_reference(query, kv, kv, cache, plan, scale)


def lens_for(block_size):
    """Ragged lengths: 1, exact block multiples, ragged tails, several 64-key chunks."""
    return [1, block_size, 2 * block_size, 3, 37, 64, 65, 150, 200 + block_size - 1]


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(head_dim, block_size, num_kv_heads, group, window, dtype):
    seq_lens = lens_for(block_size)
    q, cache, tables, lens = make_decode_batch(seq_lens, block_size, num_kv_heads * group,
                                               num_kv_heads, head_dim, dtype, q_scale=2.0)
    scale = head_dim ** -0.5
    out = cpa.paged_attention_decode(q, cache, tables, lens, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, cache, tables, lens, scale, window)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if dtype != torch.float32:
        # Closer check: against float32 maths on the same (rounded) inputs, the kernel
        # should be off by little more than the output's own rounding.
        ref32 = reference(q.float(), cache.float(), tables, lens, scale, window)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.float(), ref32, atol=2 * eps, rtol=2 * eps)


@pytest.fixture(params=cpa.V_PASSES)
def v_pass(request):
    """Each of the decode kernel's V passes in turn (skipped where not built)."""
    if request.param not in cpa.decode_v_passes():
        pytest.skip(f"the {request.param} V pass is not built here (needs AVX512-BF16)")
    return request.param


@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_matches_reference_with_either_v_pass(head_dim, block_size, num_kv_heads, group,
                                                   window, v_pass):
    """bf16 under each V pass: within the output's own rounding of float32 maths."""
    seq_lens = lens_for(block_size)
    q, cache, tables, lens = make_decode_batch(seq_lens, block_size, num_kv_heads * group,
                                               num_kv_heads, head_dim, torch.bfloat16,
                                               q_scale=2.0)
    scale = head_dim ** -0.5
    out = cpa.paged_attention_decode(q, cache, tables, lens, scale, window, v_pass=v_pass)
    ref32 = reference(q.float(), cache.float(), tables, lens, scale, window)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.float(), ref32, atol=2 * eps, rtol=2 * eps)


def test_the_v_passes_differ_only_by_the_rounding_of_probabilities():
    if "paired" not in cpa.decode_v_passes():
        pytest.skip("the paired V pass is not built here (needs AVX512-BF16)")
    q, cache, tables, lens = make_decode_batch([37, 150, 301], 16, 9, 3, 64, torch.bfloat16,
                                               seed=4, q_scale=3.0)
    outs = {name: cpa.paged_attention_decode(q, cache, tables, lens, 0.125, v_pass=name)
            for name in cpa.V_PASSES}
    # both are taken (the switch is real) and agree within a step of the bf16 output
    assert not torch.equal(outs["widened"], outs["paired"])
    torch.testing.assert_close(outs["paired"].float(), outs["widened"].float(),
                               atol=2 ** -7, rtol=2 ** -7)
    # the default is the widened pass; other dtypes take it whatever is asked
    assert torch.equal(cpa.paged_attention_decode(q, cache, tables, lens, 0.125),
                       outs["widened"])
    q32, cache32 = q.float(), cache.float()
    assert torch.equal(cpa.paged_attention_decode(q32, cache32, tables, lens, 0.125,
                                                  v_pass="paired"),
                       cpa.paged_attention_decode(q32, cache32, tables, lens, 0.125))


def test_an_unknown_v_pass_is_refused():
    q, cache, tables, lens = make_decode_batch([5], 4, 2, 1, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="not built"):
        cpa.paged_attention_decode(q, cache, tables, lens, 0.125, v_pass="fast")
    with pytest.raises(RuntimeError, match="v_pass 7"):
        cpa.cpu_extension.require().paged_attention_decode(q, cache, tables, lens, 0.125,
                                                           None, False, 7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_equal_value_rows_come_back_exactly(head_dim, dtype, v_pass):
    """Every key of a kv head with the same value row: whatever the scores, the output is
    that row, bit for bit in a 16-bit dtype (the float32 sums' last-bit error rounds
    away). On AVX512-BF16 the V pass pairs keys and holds each head's dims in another
    order until the end: odd key counts, padding and the order put back are all seen."""
    q, cache, tables, lens = make_decode_batch([1, 2, 37, 64, 65, 150, 301], 16, 9, 3,
                                               head_dim, dtype, seed=11, q_scale=6.0)
    rows = torch.randn(3, head_dim, generator=torch.Generator().manual_seed(12)).to(dtype)
    cache[1] = rows  # [num_blocks, block_size, kv_heads, hd]: every slot, every block
    out = cpa.paged_attention_decode(q, cache, tables, lens, head_dim ** -0.5, v_pass=v_pass)
    assert torch.equal(out, rows.repeat_interleave(3, dim=0).expand_as(out))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80])  # register-blocked rows and the any-dim path
def test_fp8_cache_matches_reference(head_dim, dtype, kv_dtype):
    """An fp8 cache (memory.kv_cache_dtype) under 32- or 16-bit queries: the kernel reads
    each element as the reference widens it (the cache's exact values)."""
    from kernels.kv_quant import quantize_kv
    q, cache, tables, lens = make_decode_batch(lens_for(4), 4, 6, 2, head_dim, dtype,
                                               q_scale=2.0)
    cache = quantize_kv(cache.float() * 3, kv_dtype)  # |x| up to ~15: several exponents
    window = 5 if head_dim == 80 else None
    out = cpa.paged_attention_decode(q, cache, tables, lens, head_dim ** -0.5, window)
    assert out.dtype == dtype
    ref32 = reference(q.float(), cache.float(), tables, lens, head_dim ** -0.5, window)
    tol = TOL[dtype] if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref32, atol=tol * 3, rtol=tol)
    torch.testing.assert_close(out.float(), reference(q, cache, tables, lens, head_dim ** -0.5,
                                                      window).float(),
                               atol=TOL[dtype] * 3, rtol=TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_fp8_every_value_widens_exactly(head_dim, kv_dtype):
    """One key per request: the output is that key's value row, so every finite fp8 bit
    pattern (subnormals, zeros, the largest) must come back exactly as torch widens it."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(bits.view(kv_dtype).float())
    bits = bits[finite]
    n = len(bits)
    cache = torch.zeros(2, n + 1, 1, 1, head_dim, dtype=torch.uint8)
    cache[1, 1:, 0, 0, :] = bits[:, None]  # request r's value row: bit pattern r everywhere
    cache = cache.view(kv_dtype)
    tables = torch.arange(1, n + 1, dtype=torch.int64)[:, None]
    q = torch.zeros(n, 1, head_dim)
    out = cpa.paged_attention_decode(q, cache, tables, torch.ones(n, dtype=torch.int64), 1.0)
    assert torch.equal(out[:, 0, :], bits.view(kv_dtype).float()[:, None].expand(n, head_dim))


@pytest.mark.parametrize("head_dim", [16, 80, 96])
def test_other_head_dims(head_dim):
    q, cache, tables, lens = make_decode_batch([1, 7, 33, 100], 4, 6, 2, head_dim,
                                               torch.float32)
    out = cpa.paged_attention_decode(q, cache, tables, lens, 0.3)
    torch.testing.assert_close(out, reference(q, cache, tables, lens, 0.3, None),
                               atol=1e-5, rtol=1e-5)


def test_large_scores_rescale_across_chunks():
    # Scores spanning tens of units: the running max moves between 64-key chunks.
    q, cache, tables, lens = make_decode_batch([300, 129, 64], 16, 4, 4, 64,
                                               torch.float32, q_scale=8.0)
    idx = torch.arange(lens.max().item())
    for r in range(len(lens)):  # keys growing along the sequence: later chunks win
        for p in range(int(lens[r])):
            b, o = tables[r, p // 16], p % 16
            cache[0, b, o] *= 1 + idx[p] / 100
    out = cpa.paged_attention_decode(q, cache, tables, lens, 0.125)
    torch.testing.assert_close(out, reference(q, cache, tables, lens, 0.125, None),
                               atol=1e-5, rtol=1e-5)


# Rows past 512 visible keys are cut into partitions of 512 (paged_attention_decode.cpp,
# kPartition), each a work item of its own, merged at the end: lengths at and around the
# cuts, windows that start mid-partition, and a row whose scores grow along it so that
# the running max moves from partition to partition.
LONG_LENS = [511, 512, 513, 1100, 1600, 7, 2049]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 600, 1030])
def test_long_rows_cut_into_partitions(dtype, window):
    q, cache, tables, lens = make_decode_batch(LONG_LENS, 16, 9, 3, 64, dtype, seed=3)
    out = cpa.paged_attention_decode(q, cache, tables, lens, 0.125, window)
    ref32 = reference(q.float(), cache.float(), tables, lens, 0.125, window)
    torch.testing.assert_close(out.float(), ref32, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_long_rows_with_an_fp8_cache(kv_dtype):
    q, cache, tables, lens = make_decode_batch([1100, 513], 16, 6, 2, 64, torch.bfloat16)
    cache8 = cache.to(kv_dtype)
    out = cpa.paged_attention_decode(q, cache8, tables, lens, 0.125)
    ref32 = reference(q.float(), cache8.float(), tables, lens, 0.125, None)
    torch.testing.assert_close(out.float(), ref32, atol=2e-2, rtol=2e-2)


def test_large_scores_rescale_across_partitions():
    q, cache, tables, lens = make_decode_batch([1500, 700], 16, 4, 4, 64, torch.float32,
                                               q_scale=8.0)
    for r in range(len(lens)):  # keys growing along the sequence: later partitions win
        for p in range(int(lens[r])):
            cache[0, tables[r, p // 16], p % 16] *= 1 + p / 300
    out = cpa.paged_attention_decode(q, cache, tables, lens, 0.125)
    # against float64: with scores in the hundreds torch's float32 reference is itself
    # 1e-5 off (so is the kernel, partitioned or not)
    ref64 = reference(q.double(), cache.double(), tables, lens, 0.125, None)
    torch.testing.assert_close(out.double(), ref64, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_alone_and_in_any_batch_when_batch_invariant(dtype):
    # The cut depends on the row alone: batch-invariant mode (README) relies on it. Alone,
    # rows 2 (700 keys) and 6 (170) would be cut finer without the flag.
    q, cache, tables, lens = make_decode_batch([1300, 40, 700, 2, 600, 900, 170], 16, 9, 3,
                                               64, dtype, seed=5)
    batch = cpa.paged_attention_decode(q, cache, tables, lens, 0.125, batch_invariant=True)
    for r in (0, 2, 4, 6):
        alone = cpa.paged_attention_decode(q[r:r + 1], cache, tables[r:r + 1],
                                           lens[r:r + 1], 0.125, batch_invariant=True)
        assert torch.equal(alone[0], batch[r])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpa.paged_attention_decode(q, cache, tables, lens, 0.125, batch_invariant=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, batch)


# One or two requests leave the threads short of work items: without batch_invariant
# their keys are cut finer than every 512 (down to 64), and the partial results merged.
@pytest.mark.parametrize("lens", [[100], [170], [300], [511], [700], [1500], [170, 430]],
                         ids=str)
@pytest.mark.parametrize("window", [None, 90])
def test_one_or_two_requests_are_cut_finer(lens, window):
    q, cache, tables, seq_lens = make_decode_batch(lens, 16, 9, 3, 64, torch.float32,
                                                   seed=7, q_scale=8.0)
    for r in range(len(lens)):  # keys growing along the row: later partitions win
        for p in range(lens[r]):
            cache[0, tables[r, p // 16], p % 16] *= 1 + p / 100
    fine = cpa.paged_attention_decode(q, cache, tables, seq_lens, 0.125, window)
    ref64 = reference(q.double(), cache.double(), tables, seq_lens, 0.125, window)
    torch.testing.assert_close(fine.double(), ref64, atol=2e-5, rtol=2e-5)
    whole = cpa.paged_attention_decode(q, cache, tables, seq_lens, 0.125, window,
                                       batch_invariant=True)
    torch.testing.assert_close(whole.double(), ref64, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lens", [[170], [300], [700], [170, 430]], ids=str)
def test_the_finer_cut_is_taken_only_without_batch_invariant(lens):
    # Cut differently, the partial sums add up in another order: some bits differ.
    q, cache, tables, seq_lens = make_decode_batch(lens, 16, 9, 3, 64, torch.float32, seed=8)
    fine = cpa.paged_attention_decode(q, cache, tables, seq_lens, 0.125)
    whole = cpa.paged_attention_decode(q, cache, tables, seq_lens, 0.125, batch_invariant=True)
    assert not torch.equal(fine, whole)
    # with as many requests as the threads want items (4 each), nothing is cut finer
    many = lens * (4 * torch.get_num_threads())
    q, cache, tables, seq_lens = make_decode_batch(many, 16, 9, 3, 64, torch.float32, seed=8)
    assert torch.equal(cpa.paged_attention_decode(q, cache, tables, seq_lens, 0.125),
                       cpa.paged_attention_decode(q, cache, tables, seq_lens, 0.125,
                                                  batch_invariant=True))


def test_int32_tables_and_strided_query():
    q, cache, tables, lens = make_decode_batch([5, 17, 40], 4, 8, 2, 64, torch.float32)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)  # query as a view, as a fused qkv
    q_view = qkv[:, :8]
    assert not q_view.is_contiguous()
    out = cpa.paged_attention_decode(q_view, cache, tables.to(torch.int32),
                                     lens.to(torch.int32), 0.125)
    torch.testing.assert_close(out, reference(q, cache, tables, lens, 0.125, None),
                               atol=1e-5, rtol=1e-5)


def test_same_result_for_any_thread_count():
    q, cache, tables, lens = make_decode_batch([3, 70, 16, 129, 1, 40], 16, 9, 3, 64,
                                               torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpa.paged_attention_decode(q, cache, tables, lens, 0.125)
        torch.set_num_threads(max(2, before))
        many = cpa.paged_attention_decode(q, cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_rejects_block_ids_outside_the_cache():
    q, cache, tables, lens = make_decode_batch([5, 9], 4, 2, 2, 64, torch.float32)
    tables[1, 2] = cache.shape[1]  # the third block of a 9-token request
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpa.paged_attention_decode(q, cache, tables, lens, 0.125)
    lens[0] = tables.shape[1] * 4 + 1
    with pytest.raises(RuntimeError, match="does not fit"):
        cpa.paged_attention_decode(q, cache, tables, lens, 0.125)


def test_empty_batch():
    q, cache, tables, lens = make_decode_batch([5], 4, 2, 2, 64, torch.float32)
    out = cpa.paged_attention_decode(q[:0], cache, tables[:0], lens[:0], 0.125)
    assert out.shape == (0, 2, 64)


def test_disable_env_switches_the_kernel_off(monkeypatch):
    monkeypatch.setenv(cpa.DISABLE_ENV, "1")
    assert not cpa.is_available()
    assert cpa.DISABLE_ENV in cpa.unavailable_reason()


def test_build_failure_warns_once_and_reports_unavailable(tmp_path):
    # A fresh build folder and a compiler that does not exist: the build must fail
    # softly (one warning, False), and a direct call must raise, not crash.
    script = (
        "import torch\n"
        "from kernels import cpu_paged_attention as c\n"
        "assert not c.is_available() and not c.is_available()\n"
        "assert 'nonexistent' in c.unavailable_reason()\n"
        "try:\n"
        "    c.paged_attention_decode(torch.zeros(1, 1, 8), torch.zeros(2, 1, 1, 1, 8),\n"
        "                             torch.zeros(1, 1, dtype=torch.long),\n"
        "                             torch.ones(1, dtype=torch.long), 1.0)\n"
        "except RuntimeError as e:\n"
        "    assert 'unavailable' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n")
    env = dict(os.environ, FOLIO_CACHE_DIR=str(tmp_path), CXX="/nonexistent/c++")
    env.pop(cpa.DISABLE_ENV, None)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    logs = proc.stdout + proc.stderr  # structlog, unconfigured, prints to stdout
    assert proc.returncode == 0, logs
    assert logs.count("native CPU kernels unavailable") == 1, logs
