"""LoRA on the CPU for decode-sized steps: each slot's rows padded to one length, so
a fused projection's shrink and expand are a few batched GEMMs instead of one GEMM
per run and slice.

At decode a step has one row per request; grouped by adapter, S adapters give S short
runs, and the per-run path (kernels/lora_shrink.py, lora_expand.py) issues
S x (1 + slices) small GEMMs per projection, whose call overhead outweighs their
arithmetic (benchmarks/lora_kernels.py, ``slot_batch`` vs ``runs``). Here the step's
adapter rows are laid out once per step as ``[num_slots, rows_per_slot]`` over the
slots ``first_slot ..`` the step uses (each slot's rows padded to the longest), then
per projection::

    xa    = bmm(x[gather], a_store[slots])                        [n, L, slices*R]
    delta = cat_i bmm(xa[..., i*R:(i+1)*R], b_store[slots][..., cols_i])   [n, L, out]
    y[lo:hi] += delta[scatter]        (zero on base-model rows between lo and hi)

Products and sums in float32 and one rounding into ``y``, as the per-run path. Padded
rows compute values nobody reads, so the layout is only taken while padding stays
small (see ``make_slot_batch``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_extension

# Taken when padded rows are at most this many times the adapter rows, and a slot's
# rows at most MAX_ROWS_PER_SLOT: past those, the per-run GEMMs are as fast and pad
# nothing (measured in benchmarks/lora_kernels.py on 2 cores).
MAX_PADDING_FACTOR = 2
MAX_ROWS_PER_SLOT = 64


@dataclass(slots=True)
class SlotBatch:
    """One step's adapter rows regrouped per slot (see the module docstring)."""

    first_slot: int
    num_slots: int
    rows_per_slot: int
    lo: int  # the rows [lo, hi) of the step that the runs span
    hi: int
    gather: torch.Tensor  # [num_slots * rows_per_slot] int64: the step row of each padded row
    scatter: torch.Tensor  # [hi - lo] int64: the padded row of each step row
    keep: torch.Tensor | None  # [hi - lo, 1] float32, 0 on base rows; None: there are none


def make_slot_batch(runs) -> SlotBatch | None:
    """The padded layout of ``runs`` (kernels/lora_mapping.py, in token order), or None
    where the per-run path is the better one: a single run, or too much padding."""
    if len(runs) < 2:
        return None
    rows_of: dict[int, list[int]] = {}
    for run in runs:
        rows_of.setdefault(run.slot, []).extend(range(run.start, run.end))
    first, last = min(rows_of), max(rows_of)
    num_slots = last - first + 1
    rows_per_slot = max(len(rows) for rows in rows_of.values())
    num_rows = sum(len(rows) for rows in rows_of.values())
    if (rows_per_slot > MAX_ROWS_PER_SLOT
            or num_slots * rows_per_slot > MAX_PADDING_FACTOR * num_rows):
        return None
    lo, hi = runs[0].start, runs[-1].end
    gather = [lo] * (num_slots * rows_per_slot)  # padding reads row lo, never written back
    scatter = [0] * (hi - lo)
    keep = [0.0] * (hi - lo)
    for slot, rows in rows_of.items():
        base = (slot - first) * rows_per_slot
        for i, row in enumerate(rows):
            gather[base + i] = row
            scatter[row - lo] = base + i
            keep[row - lo] = 1.0
    has_base_rows = num_rows < hi - lo
    return SlotBatch(first_slot=first, num_slots=num_slots, rows_per_slot=rows_per_slot,
                     lo=lo, hi=hi, gather=torch.tensor(gather, dtype=torch.int64),
                     scatter=torch.tensor(scatter, dtype=torch.int64),
                     keep=torch.tensor(keep).unsqueeze(1) if has_base_rows else None)


def lora_add_slot_batch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        slice_widths: Sequence[int], rank: int, batch: SlotBatch) -> None:
    """``y += `` the LoRA delta of one fused projection, in place.

    ``x`` [T, in]; ``a`` [S, slices*rank, in] and ``b`` [S, out, rank] are the logical
    views of the worker's ``[S, in, K]`` / ``[S, rank, out]`` stores
    (worker/lora/lora_slots.py); ``slice_widths`` tile ``y``'s columns in order."""
    n, rows = batch.num_slots, batch.rows_per_slot
    slots = slice(batch.first_slot, batch.first_slot + n)
    a_store = a.transpose(1, 2)[slots]  # [n, in, K], contiguous per slot
    b_store = b.transpose(1, 2)[slots]  # [n, rank, out]
    xg = x.index_select(0, batch.gather).to(a_store.dtype).view(n, rows, x.shape[1])
    xa = torch.bmm(xg, a_store)
    parts, col = [], 0
    for i, width in enumerate(slice_widths):
        parts.append(torch.bmm(xa[:, :, i * rank:(i + 1) * rank],
                               b_store[:, :, col:col + width]))
        col += width
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    step_rows = delta.view(n * rows, -1).index_select(0, batch.scatter)
    if batch.keep is not None:
        step_rows.mul_(batch.keep.to(step_rows.dtype))
    y[batch.lo:batch.hi] += step_rows


def lora_add_decode(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    slice_widths: Sequence[int], rank: int, token_slots: torch.Tensor,
                    batch: SlotBatch) -> None:
    """A decode-sized step's LoRA for one fused projection (arguments as
    :func:`lora_add_slot_batch`): the native kernel (kernels/csrc/lora_decode.cpp, one
    call instead of a handful of torch ops) when it is built, else the batched GEMMs."""
    if cpu_extension.is_available() and y.stride(1) == 1 and x.stride(1) == 1:
        cpu_extension.require().lora_decode(y, x, a.transpose(1, 2), b.transpose(1, 2),
                                            token_slots, rank, list(slice_widths))
    else:
        lora_add_slot_batch(y, x, a, b, slice_widths, rank, batch)
