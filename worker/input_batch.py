"""Build one step's flat, ragged model input from the runner's per-request state.

Requests are laid out decodes first (one new token each), then prefill chunks, which
is the order the paged-attention plan expects::

    input_ids  [ d0 d1 | p0 p0 p0 | p1 p1 ]
    positions  [ 17 40 |  0  1  2 |  8  9 ]     (num_computed_tokens onward)
    slot_mapping = block_table[pos // block_size] * block_size + pos % block_size
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.paged_attention import make_plan
from worker.models.llama import AttentionContext
from worker.request_state import CachedRequestState


@dataclass(slots=True)
class InputBatch:
    """Tensors for one forward pass plus the bookkeeping to read its results back."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionContext
    logits_indices: torch.Tensor  # [S] last token of each request that samples
    sampling_states: list[CachedRequestState]  # the S requests, in logits order
    query_start_loc: list[int]
    seq_lens: list[int]


def build_input_batch(states: list[CachedRequestState], num_scheduled: list[int],
                      block_size: int, sliding_window: int | None,
                      use_native_decode: bool = False) -> InputBatch:
    """``states[i]`` computes ``num_scheduled[i]`` tokens from its num_computed_tokens."""
    order = sorted(range(len(states)), key=lambda i: num_scheduled[i] != 1)
    states = [states[i] for i in order]
    counts = [num_scheduled[i] for i in order]
    token_chunks, query_start_loc, seq_lens = [], [0], []
    logits_indices, sampling_states = [], []
    for state, n in zip(states, counts):
        start = state.num_computed_tokens
        token_chunks.append(state.token_ids[start:start + n])
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(start + n)
        if start + n == len(state.token_ids):
            logits_indices.append(query_start_loc[-1] - 1)
            sampling_states.append(state)
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
    block_tables_t = torch.from_numpy(block_tables)
    plan = make_plan(query_start_loc, seq_lens, block_tables_t, block_size, sliding_window,
                     use_native_decode)
    flat_ids = [t for chunk in token_chunks for t in chunk]
    return InputBatch(
        input_ids=torch.tensor(flat_ids, dtype=torch.int64),
        positions=torch.from_numpy(positions),
        attn=AttentionContext(slot_mapping=torch.from_numpy(slot_mapping), plan=plan),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        sampling_states=sampling_states,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
