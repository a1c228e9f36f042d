"""Build one step's flat, ragged model input from the runner's per-request state.

Requests are laid out decodes first (one new token each), then prefill chunks, which
is the order the paged-attention plan expects::

    input_ids  [ d0 d1 | p0 p0 p0 | p1 p1 ]
    positions  [ 17 40 |  0  1  2 |  8  9 ]     (num_computed_tokens onward)
    slot_mapping = block_table[pos // block_size] * block_size + pos % block_size

Everything is computed on the host with numpy; for a GPU the token-level arrays travel
in one int64 copy and the attention metadata in one int32 copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.paged_attention import make_plan, make_ragged_plan, pack_aligned
from worker.attention_backend import NATIVE_CPU, TORCH, AttentionBackend
from worker.models.llama import AttentionContext
from worker.request_state import CachedRequestState

_CPU = torch.device("cpu")


@dataclass(slots=True)
class InputBatch:
    """Tensors for one forward pass plus the bookkeeping to read its results back."""

    input_ids: torch.Tensor  # [T] on the model's device
    positions: torch.Tensor  # [T] on the model's device
    attn: AttentionContext
    logits_indices: torch.Tensor  # [S] last token of each request that samples
    sampling_states: list[CachedRequestState]  # the S requests, in logits order
    query_start_loc: list[int]
    seq_lens: list[int]
    # every scheduled request in batch order (row i spans query_start_loc[i:i + 2])
    scheduled_states: list[CachedRequestState] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return self.query_start_loc[-1] == len(self.seq_lens)


def _token_arrays(states, counts, query_start_loc, block_size):
    """input_ids (a list), positions and slot_mapping (int64 [T]), block_tables [R, W]."""
    num_tokens = query_start_loc[-1]
    req_index = np.repeat(np.arange(len(states)), counts)
    starts = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
    qsl = np.asarray(query_start_loc[:-1], dtype=np.int64)
    positions = starts[req_index] + (np.arange(num_tokens) - qsl[req_index])
    max_blocks = max(len(s.block_ids) for s in states)
    block_tables = np.zeros((len(states), max_blocks), dtype=np.int64)
    for i, s in enumerate(states):
        block_tables[i, :len(s.block_ids)] = s.block_ids
    slot_mapping = (block_tables[req_index, positions // block_size] * block_size
                    + positions % block_size)
    input_ids = [t for s, n in zip(states, counts)
                 for t in s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n]]
    return input_ids, positions, slot_mapping, block_tables


def build_input_batch(states: list[CachedRequestState], num_scheduled: list[int],
                      block_size: int, sliding_window: int | None,
                      backend: AttentionBackend | None = None) -> InputBatch:
    """``states[i]`` computes ``num_scheduled[i]`` tokens from its num_computed_tokens.

    ``backend`` None means the torch reference on the CPU.
    """
    backend = backend or AttentionBackend(TORCH, _CPU)
    order = sorted(range(len(states)), key=lambda i: num_scheduled[i] != 1)
    states = [states[i] for i in order]
    counts = [num_scheduled[i] for i in order]
    query_start_loc, seq_lens = [0], []
    logits_indices, sampling_states = [], []
    for state, n in zip(states, counts):
        start = state.num_computed_tokens
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(start + n)
        if start + n == len(state.token_ids):
            logits_indices.append(query_start_loc[-1] - 1)
            sampling_states.append(state)
    input_ids, positions, slot_mapping, block_tables = _token_arrays(
        states, counts, query_start_loc, block_size)
    device = backend.device
    if backend.is_triton:
        plan = make_ragged_plan(query_start_loc, seq_lens, block_tables, device,
                                backend.num_kv_heads, sliding_window, backend.num_sms)
    else:
        plan = make_plan(query_start_loc, seq_lens, torch.from_numpy(block_tables),
                         block_size, sliding_window, backend.name == NATIVE_CPU)
        if device.type != "cpu":
            plan = plan.to(device)
    if device.type == "cpu":
        input_ids, positions, slot_mapping, logits_indices = (
            torch.tensor(input_ids, dtype=torch.int64), torch.from_numpy(positions),
            torch.from_numpy(slot_mapping), torch.tensor(logits_indices, dtype=torch.int64))
    else:  # one host-to-device copy for every token-level array
        input_ids, positions, slot_mapping, logits_indices = pack_aligned(
            [input_ids, positions, slot_mapping, logits_indices], np.int64, device)
    return InputBatch(
        input_ids=input_ids, positions=positions,
        attn=AttentionContext(slot_mapping=slot_mapping, plan=plan),
        logits_indices=logits_indices, sampling_states=sampling_states,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scheduled_states=states)
