"""Rank 0 → the other ranks: each step's inputs as tensors over torch.distributed.

Every message is a fixed header broadcast, then what the header announces::

    header  int64 [8]: command, then its counts
    STEP    counts T tokens, R attention rows, W block-table width, C block copies
            payload int64 [3T + (R+1) + R + R*W + 2C]:
            input_ids | positions | slot_mapping | query_start_loc | seq_lens |
            block_tables (row-major) | copy src | copy dst
    LOGITS  counts n rows, H hidden; payload [n, H] in the model dtype: the hidden
            states whose logits rank 0 wants next (every rank computes its vocabulary
            slice, then the slices are gathered on rank 0)
    STOP    no payload; the other ranks leave their loop

Only tensors cross: the other ranks rebuild the attention plan from the same arrays with
the same function rank 0 used (worker/input_batch.py), so their plan is rank 0's plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.distributed.tp_group import TPGroup

STEP, LOGITS, STOP = 1, 2, 3
HEADER_LEN = 8


@dataclass(slots=True)
class StepArrays:
    """The host arrays one forward pass is built from (worker/input_batch.py)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: list[int]  # [R + 1] attention rows
    seq_lens: list[int]  # [R]
    block_tables: np.ndarray  # [R, W]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class StepMessage:
    """One received message: its command and what came with it."""

    command: int
    arrays: StepArrays | None = None
    copies: tuple[list[int], list[int]] = ([], [])
    hidden: torch.Tensor | None = None


class StepChannel:
    """Both ends of the broadcast: rank 0 sends, every other rank receives in order."""

    def __init__(self, tp: TPGroup, hidden_size: int, dtype: torch.dtype):
        self.tp, self.hidden_size, self.dtype = tp, hidden_size, dtype

    def _header(self, values: list[int] | None = None) -> list[int]:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.tp.device)
        if values is not None:
            header[:len(values)] = torch.tensor(values, dtype=torch.int64)
        return self.tp.broadcast(header).tolist()

    # rank 0
    def send_step(self, arrays: StepArrays | None, src: list[int], dst: list[int]) -> None:
        """The step's batch (None: only block copies) and its block copies."""
        if arrays is None:
            arrays = StepArrays(*(np.zeros(0, np.int64),) * 3, [0], [], np.zeros((0, 0)))
        bt = np.asarray(arrays.block_tables, dtype=np.int64)
        rows, width = len(arrays.seq_lens), (bt.shape[1] if bt.ndim == 2 else 0)
        self._header([STEP, arrays.num_tokens, rows, width, len(src)])
        payload = np.concatenate([
            np.asarray(a, dtype=np.int64).reshape(-1) for a in (
                arrays.input_ids, arrays.positions, arrays.slot_mapping,
                arrays.query_start_loc, arrays.seq_lens, bt, src, dst)])
        self.tp.broadcast(torch.from_numpy(payload).to(self.tp.device))

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Ask every rank for its logits slice of these rows (call compute_logits next)."""
        self._header([LOGITS, hidden.shape[0], hidden.shape[1]])
        self.tp.broadcast(hidden.to(self.dtype).contiguous())

    def send_stop(self) -> None:
        self._header([STOP])

    # every other rank
    def receive(self) -> StepMessage:
        header = self._header()
        command = header[0]
        if command == LOGITS:
            hidden = torch.empty(header[1], header[2], dtype=self.dtype, device=self.tp.device)
            return StepMessage(LOGITS, hidden=self.tp.broadcast(hidden))
        if command != STEP:
            return StepMessage(command)
        t, r, w, c = header[1:5]
        payload = torch.empty(3 * t + 2 * r + 1 + r * w + 2 * c, dtype=torch.int64,
                              device=self.tp.device)
        parts = np.split(self.tp.broadcast(payload).cpu().numpy(),
                         np.cumsum([t, t, t, r + 1, r, r * w, c]))
        input_ids, positions, slots, qsl, seq_lens, bt, src, dst = parts
        arrays = (StepArrays(input_ids, positions, slots, qsl.tolist(), seq_lens.tolist(),
                             bt.reshape(r, w)) if t else None)
        return StepMessage(STEP, arrays, (src.tolist(), dst.tolist()))
