"""Which LoRA slot each token of a step uses, in the shapes the LoRA kernels read.

A step's tokens lie end to end (worker/input_batch.py); each request brings the slot
of its adapter (-1: the base model, no adapter). From the per-request slots::

    token_slots   [ 2  2 -1  0  0  0 -1 -1  2  2 ]     one slot per token
    runs          (2, 0, 2) (0, 3, 6) (2, 8, 10)       contiguous tokens of one slot
    sorted ids    [ 3  4  5 | 0  1  8  9 ]             adapter tokens grouped by slot
    group_slots   [ 0 | 2 ],  group_starts [0, 3, 7]

The torch references read ``token_slots``; the CPU path walks ``runs`` (slices, no
gather: the input batch orders requests by adapter so runs are few), or, when the runs
are many and short (decode), takes their padded per-slot layout ``slot_batch``
(kernels/lora_slot_batch.py); the Triton
kernels (kernels/triton_lora.py) give each program a tile of one group's rows
(``sorted_token_ids``), so one
adapter matrix serves the whole tile, whether its rows are one prefill chunk (a
segment, SGMV) or decode rows gathered from across the batch (BGMV). Tokens of the
base model appear in no run and no group: they cost the LoRA path nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.lora_slot_batch import SlotBatch, make_slot_batch
from kernels.paged_attention import pack_aligned

NO_SLOT = -1


@dataclass(slots=True)
class LoRARun:
    """Tokens ``[start, end)`` of the step, all of slot ``slot``."""

    slot: int
    start: int
    end: int


@dataclass(slots=True)
class LoRAMapping:
    """One step's token → slot map (see the module docstring); tensors on the device."""

    token_slots: torch.Tensor  # [T] int32, NO_SLOT for base-model tokens
    sorted_token_ids: torch.Tensor  # [N] int32, tokens with an adapter, grouped by slot
    group_slots: torch.Tensor  # [G] int32, the slot of each group
    group_starts: torch.Tensor  # [G + 1] int32, offsets of the groups in sorted_token_ids
    max_group_rows: int  # rows of the largest group (the kernels' grid)
    runs: list[LoRARun]  # host side, in token order
    slot_batch: SlotBatch | None = None  # CPU, decode-sized steps: kernels/lora_slot_batch.py

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]


def make_lora_mapping(request_slots: list[int], query_start_loc: list[int],
                      device: torch.device) -> LoRAMapping:
    """The mapping of a step whose request i has slot ``request_slots[i]`` (NO_SLOT: none)
    and tokens ``query_start_loc[i]:query_start_loc[i + 1]``."""
    runs: list[LoRARun] = []
    for slot, start, end in zip(request_slots, query_start_loc, query_start_loc[1:]):
        if slot == NO_SLOT or start == end:
            continue
        if runs and runs[-1].slot == slot and runs[-1].end == start:
            runs[-1].end = end  # neighbours of one adapter merge into one run
        else:
            runs.append(LoRARun(slot, start, end))
    counts = np.diff(np.asarray(query_start_loc, dtype=np.int64))
    token_slots = np.repeat(np.asarray(request_slots, dtype=np.int32), counts)
    adapter_tokens = np.flatnonzero(token_slots != NO_SLOT)
    order = np.argsort(token_slots[adapter_tokens], kind="stable")
    sorted_ids = adapter_tokens[order]
    group_slots, group_sizes = np.unique(token_slots[sorted_ids], return_counts=True)
    group_starts = np.concatenate([[0], np.cumsum(group_sizes)])
    slots_t, sorted_t, groups_t, starts_t = pack_aligned(
        [token_slots, sorted_ids, group_slots, group_starts], np.int32, device)
    return LoRAMapping(token_slots=slots_t, sorted_token_ids=sorted_t, group_slots=groups_t,
                       group_starts=starts_t,
                       max_group_rows=int(group_sizes.max()) if len(group_sizes) else 0,
                       runs=runs,
                       slot_batch=None if device.type == "cuda" else make_slot_batch(runs))
