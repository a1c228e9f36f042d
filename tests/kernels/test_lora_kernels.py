"""LoRA shrink/expand: the Triton kernels and the CPU path against the torch reference.

A grid of ranks, slot mixes (base rows among adapter rows, one slot, every row on the
base model, slots of the stack nobody uses) and dtypes. The expand writes a column
slice of a wider output, as a fused q/k/v projection does.
"""
import os

import pytest
import torch

from kernels import cpu_extension
from kernels.lora_expand import lora_expand, lora_expand_cpu, lora_expand_reference
from kernels.lora_mapping import NO_SLOT, make_lora_mapping
from kernels.lora_slot_batch import lora_add_slot_batch
from kernels.lora_shrink import lora_shrink, lora_shrink_cpu, lora_shrink_reference
from kernels.triton_lora import lora_expand_triton, lora_shrink_triton
from tests.kernels.ragged_case import DEVICE, INTERPRETING

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NUM_SLOTS = 4
# per request: (slot, tokens); slot 3 of the stack is never used, slot 1 holds zeros
MIXES = {
    "mixed": [(0, 1), (NO_SLOT, 1), (2, 1), (0, 1), (2, 9), (NO_SLOT, 5), (0, 20)],
    "one_slot": [(2, 1), (2, 1), (2, 17)],
    "base_only": [(NO_SLOT, 3), (NO_SLOT, 1)],
    "zero_slot": [(1, 2), (0, 3)],
}


def _case(mix, rank, dtype, weight_dtype=None, hidden=64, out=96, seed=0):
    gen = torch.Generator().manual_seed(seed + rank)
    slots = [s for s, _ in MIXES[mix]]
    qsl = [0]
    for _, n in MIXES[mix]:
        qsl.append(qsl[-1] + n)
    x = torch.randn(qsl[-1], hidden, generator=gen).to(dtype)
    # stored [S, in, K] / [S, K, N] contiguous and viewed transposed, as the worker does
    weight_dtype = weight_dtype or dtype
    a = (torch.randn(NUM_SLOTS, hidden, rank, generator=gen) / hidden ** 0.5).to(weight_dtype)
    b = (torch.randn(NUM_SLOTS, rank, out, generator=gen) / rank ** 0.5).to(weight_dtype)
    a[1], b[1] = 0, 0
    return x, a.transpose(1, 2), b.transpose(1, 2), slots, qsl


def _assert_close(got, want, dtype):
    if INTERPRETING and dtype == torch.bfloat16:  # the interpreter truncates to bf16
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype],
                                   rtol=TOL[dtype])


# Triton: slots in the model's dtype (as on a GPU); CPU: float32 slots under float32 or
# bfloat16 activations, or bfloat16 slots (worker/lora/slot_dtype.py picks per machine).
IMPLS = [("triton", d, d) for d in DTYPES] + [("cpu", torch.float32, torch.float32),
                                              ("cpu", torch.bfloat16, torch.float32),
                                              ("cpu", torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("impl,dtype,weight_dtype", IMPLS,
                         ids=[f"{i}-{IDS[DTYPES.index(d)]}" for i, d, _ in IMPLS])
@pytest.mark.parametrize("rank", [8, 16, 48])
@pytest.mark.parametrize("mix", list(MIXES))
def test_shrink_then_expand_match_the_reference(impl, dtype, weight_dtype, mix, rank):
    x, a, b, slots, qsl = _case(mix, rank, dtype, weight_dtype)
    device = DEVICE if impl == "triton" else torch.device("cpu")
    mapping = make_lora_mapping(slots, qsl, device)
    ref_xa = lora_shrink_reference(x, a, mapping.token_slots.cpu())
    y0 = torch.randn(x.shape[0], 3 * b.shape[1], generator=torch.Generator().manual_seed(1))
    y0 = y0.to(dtype)
    ref_y = y0.clone()
    lora_expand_reference(ref_y[:, 40:40 + b.shape[1]], ref_xa, b, mapping.token_slots.cpu())
    shrink, expand = ((lora_shrink_triton, lora_expand_triton) if impl == "triton"
                      else (lora_shrink_cpu, lora_expand_cpu))
    xa = shrink(x.to(device), a.to(device), mapping)
    y = y0.clone().to(device)
    expand(y[:, 40:40 + b.shape[1]], xa, b.to(device), mapping)
    if impl == "triton" or weight_dtype == torch.float32:
        assert xa.dtype == torch.float32  # the shrink is not rounded before the expand
        torch.testing.assert_close(xa.cpu(), ref_xa, atol=1e-4, rtol=1e-4)
    else:  # 16-bit slots on the CPU: float32 sums, rounded once to the slots' dtype
        assert xa.dtype == weight_dtype
        _assert_close(xa.cpu(), ref_xa, weight_dtype)
    _assert_close(y.cpu(), ref_y, dtype)
    base_rows = torch.tensor([s == NO_SLOT for s, n in MIXES[mix] for _ in range(n)])
    assert torch.equal(y.cpu()[base_rows], y0[base_rows])  # base rows untouched
    assert torch.equal(xa.cpu()[base_rows], torch.zeros_like(xa.cpu()[base_rows]))
    if mix == "mixed":
        assert not torch.equal(ref_y, y0)  # the case does change something


def test_mapping_groups_runs_and_skips_base_rows():
    m = make_lora_mapping([2, 2, NO_SLOT, 0, 2], [0, 2, 3, 4, 7, 9], torch.device("cpu"))
    assert m.token_slots.tolist() == [2, 2, 2, -1, 0, 0, 0, 2, 2]
    assert [(r.slot, r.start, r.end) for r in m.runs] == [(2, 0, 3), (0, 4, 7), (2, 7, 9)]
    assert m.group_slots.tolist() == [0, 2]
    assert m.group_starts.tolist() == [0, 3, 8]
    assert m.sorted_token_ids.tolist() == [4, 5, 6, 0, 1, 2, 7, 8]
    assert m.max_group_rows == 5


def test_dispatch_on_cpu_is_the_run_path():
    x, a, b, slots, qsl = _case("mixed", 16, torch.float32)
    mapping = make_lora_mapping(slots, qsl, torch.device("cpu"))
    xa = lora_shrink(x, a, mapping)
    assert torch.equal(xa, lora_shrink_cpu(x, a, mapping))
    y1, y2 = torch.zeros(x.shape[0], b.shape[1]), torch.zeros(x.shape[0], b.shape[1])
    lora_expand(y1, xa, b, mapping)
    lora_expand_cpu(y2, xa, b, mapping)
    assert torch.equal(y1, y2)


# ---- the CPU's batched layout for decode-sized steps (kernels/lora_slot_batch.py) ----

DECODE_MIXES = {  # one row per request, as at decode; slot 0 in two runs, a base row inside
    "decode": [(0, 1), (0, 1), (2, 1), (2, 1), (NO_SLOT, 1), (3, 1), (0, 1)],
    "every_slot": [(s, 1) for s in (0, 0, 1, 1, 2, 2, 3, 3)],
    "short_chunks": [(2, 3), (3, 2), (NO_SLOT, 4), (2, 1)],
}


NATIVE_KERNELS_WANTED = os.environ.get(cpu_extension.DISABLE_ENV, "").strip().lower() in (
    "", "0", "false", "no")
SLOT_BATCH_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                     (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("dtype,weight_dtype", SLOT_BATCH_DTYPES,
                         ids=["fp32", "bf16-fp32slots", "bf16-bf16slots"])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("mix", list(DECODE_MIXES))
def test_slot_batch_matches_the_reference(mix, rank, dtype, weight_dtype):
    """A fused q/k/v-like target (three slices; widths and ranks that leave partial
    vectors): the slot batch and the native kernel against the reference and against
    the run path, slice by slice as the worker calls them."""
    gen = torch.Generator().manual_seed(rank)
    slots = [s for s, _ in DECODE_MIXES[mix]]
    qsl = [0]
    for _, n in DECODE_MIXES[mix]:
        qsl.append(qsl[-1] + n)
    widths, hidden = (40, 24, 24), 64
    x = torch.randn(qsl[-1], hidden, generator=gen).to(dtype)
    a = torch.randn(NUM_SLOTS, hidden, len(widths) * rank, generator=gen) / hidden ** 0.5
    b = torch.randn(NUM_SLOTS, rank, sum(widths), generator=gen) / rank ** 0.5
    a[1], b[1] = 0, 0
    a = a.to(weight_dtype).transpose(1, 2)  # the worker's logical views
    b = b.to(weight_dtype).transpose(1, 2)
    mapping = make_lora_mapping(slots, qsl, torch.device("cpu"))
    assert mapping.slot_batch is not None, "a decode-sized mix takes the batched layout"
    y0 = torch.randn(x.shape[0], sum(widths), generator=gen).to(dtype)
    ref_xa = lora_shrink_reference(x, a, mapping.token_slots)
    ref, runs = y0.clone(), y0.clone()
    xa = lora_shrink_cpu(x, a, mapping)
    col = 0
    for i, w in enumerate(widths):
        ks, cols = slice(i * rank, (i + 1) * rank), slice(col, col + w)
        lora_expand_reference(ref[:, cols], ref_xa[:, ks], b[:, cols], mapping.token_slots)
        lora_expand_cpu(runs[:, cols], xa[:, ks], b[:, cols], mapping)
        col += w
    got = y0.clone()
    lora_add_slot_batch(got, x, a, b, widths, rank, mapping.slot_batch)
    results = [got]
    if NATIVE_KERNELS_WANTED:  # the native kernel, given the same stores
        assert cpu_extension.is_available(), cpu_extension.unavailable_reason()
        native = y0.clone()
        cpu_extension.require().lora_decode(native, x, a.transpose(1, 2), b.transpose(1, 2),
                                            mapping.token_slots, rank, list(widths))
        results.append(native)
    base_rows = torch.tensor([s == NO_SLOT for s, n in DECODE_MIXES[mix] for _ in range(n)])
    for out in results:
        _assert_close(out, ref, dtype)
        _assert_close(out, runs, dtype)
        assert torch.equal(out[base_rows], y0[base_rows])
        assert not torch.equal(out, y0)


def test_slot_batch_is_taken_only_when_padding_is_small():
    def batch(mix):
        qsl = [0]
        for _, n in mix:
            qsl.append(qsl[-1] + n)
        return make_lora_mapping([s for s, _ in mix], qsl, torch.device("cpu")).slot_batch
    assert batch([(0, 1), (1, 1)]) is not None
    assert batch([(0, 5)]) is None  # one run: the run path is one GEMM already
    assert batch([(0, 100), (1, 1)]) is None  # a prefill chunk would pad the other slot
    assert batch([(0, 1), (4, 1)]) is None  # slots 1-3 unused: 5 padded rows for 2
    assert batch([(0, 65), (1, 65)]) is None  # past MAX_ROWS_PER_SLOT
    m = batch([(2, 1), (NO_SLOT, 1), (3, 2), (2, 1)])
    assert (m.first_slot, m.num_slots, m.rows_per_slot, m.lo, m.hi) == (2, 2, 2, 0, 5)
    assert m.gather.tolist() == [0, 4, 2, 3]
    assert m.scatter.tolist() == [0, 0, 2, 3, 1]
    assert m.keep.squeeze(1).tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
