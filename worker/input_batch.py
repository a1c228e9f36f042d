"""Build one step's flat, ragged model input from the runner's per-request state.

Requests are laid out decodes first (one new token each), then prefill chunks, which
is the order the paged-attention plan expects::

    input_ids  [ d0 d1 | p0 p0 p0 | p1 p1 ]
    positions  [ 17 40 |  0  1  2 |  8  9 ]     (num_computed_tokens onward)
    slot_mapping = block_table[pos // block_size] * block_size + pos % block_size

Everything is computed on the host with numpy; for a GPU the token-level arrays travel
in one int64 copy and the attention metadata in one int32 copy.

A request verifying k drafts computes its last token and the drafts as one k+1-token
chunk. On the CPU backends its attention runs as k+1 decode rows instead, one per
token, each over the request's block table up to its own position (its K/V are in the
cache before attention reads it): the decode kernel reads the blocks in place, and each
row's attention is computed exactly as a plain decode step would compute it::

    tokens     [ d0 | v0 v1 v2 | p0 p0 ]     v: last token + 2 drafts at 40, 41, 42
    rows       [ d0 | v0 | v1 | v2 | p0 p0 ] seq_lens [17, 41, 42, 43, 2]

In deterministic mode (``backend.per_token_rows``) every chunk is split that way, prefill
chunks included: each token's attention is then computed exactly as its decode would be.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.paged_attention import make_plan, make_ragged_plan, pack_aligned
from worker.attention_backend import NATIVE_CPU, TORCH, AttentionBackend
from worker.distributed.step_channel import StepArrays
from worker.models.llama import AttentionContext
from worker.request_state import CachedRequestState

_CPU = torch.device("cpu")


@dataclass(slots=True)
class InputBatch:
    """Tensors for one forward pass plus the bookkeeping to read its results back."""

    input_ids: torch.Tensor  # [T] on the model's device
    positions: torch.Tensor  # [T] on the model's device
    attn: AttentionContext
    # [S + drafts]: the last token of each request that samples, and with k drafts the
    # k+1 rows of its last token and its drafts (speculative decoding), request by request
    logits_indices: torch.Tensor
    sampling_states: list[CachedRequestState]  # the S requests, in logits order
    query_start_loc: list[int]  # of the attention rows (a request, or a verify token)
    seq_lens: list[int]
    lora_ids: list[int]  # each request's LoRA adapter (0: none), in batch order
    # every scheduled request in batch order; request i's tokens are
    # request_start_loc[i:i + 2] (query_start_loc splits verify chunks into rows)
    scheduled_states: list[CachedRequestState] = field(default_factory=list)
    request_start_loc: list[int] = field(default_factory=list)
    arrays: StepArrays | None = None  # what the tensors were built from (TP broadcast)

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
                 for t in s.input_token_ids(s.num_computed_tokens, n)]
    return input_ids, positions, slot_mapping, block_tables


def _is_verify(state: CachedRequestState, num_scheduled: int) -> bool:
    """A decode with drafts: its last known token and its k drafts, nothing else."""
    return bool(state.spec_token_ids) and num_scheduled == len(state.spec_token_ids) + 1


def _decode_rows(states, counts, seq_lens, block_tables, every_chunk: bool):
    """Attention rows with each verify chunk (``every_chunk``: each chunk) split into one
    decode row per token: (query_start_loc, seq_lens, block_tables) of the rows."""
    query_lens, row_lens, row_req = [], [], []
    for r, (state, n) in enumerate(zip(states, counts)):
        if every_chunk or _is_verify(state, n):
            query_lens.extend([1] * n)
            row_lens.extend(range(seq_lens[r] - n + 1, seq_lens[r] + 1))
            row_req.extend([r] * n)
        else:
            query_lens.append(n)
            row_lens.append(seq_lens[r])
            row_req.append(r)
    return [0, *np.cumsum(query_lens).tolist()], row_lens, block_tables[row_req]


def build_input_batch(states: list[CachedRequestState], num_scheduled: list[int],
                      block_size: int, sliding_window: int | None,
                      backend: AttentionBackend | None = None) -> InputBatch:
    """``states[i]`` computes ``num_scheduled[i]`` tokens from its num_computed_tokens.

    ``backend`` None means the torch reference on the CPU.
    """
    backend = backend or AttentionBackend(TORCH, _CPU)
    # decodes first (the attention plan wants them so; on CPU backends verify chunks
    # count as decode rows, module doc); within each part, requests of one LoRA adapter
    # side by side, so the LoRA kernels see few runs
    as_decodes = not backend.is_triton
    every_chunk = as_decodes and backend.per_token_rows
    order = sorted(range(len(states)), key=lambda i: (not (
        num_scheduled[i] == 1 or every_chunk
        or as_decodes and _is_verify(states[i], num_scheduled[i])), states[i].lora_id))
    states = [states[i] for i in order]
    counts = [num_scheduled[i] for i in order]
    query_start_loc, seq_lens = [0], []
    logits_indices, sampling_states = [], []
    for state, n in zip(states, counts):
        start = state.num_computed_tokens
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(start + n)
        if start + n == state.num_tokens_with_spec:
            end = query_start_loc[-1]
            logits_indices.extend(range(end - 1 - len(state.spec_token_ids), end))
            sampling_states.append(state)
    input_ids, positions, slot_mapping, block_tables = _token_arrays(
        states, counts, query_start_loc, block_size)
    request_start_loc = query_start_loc
    if every_chunk or as_decodes and any(_is_verify(s, n) for s, n in zip(states, counts)):
        query_start_loc, seq_lens, block_tables = _decode_rows(states, counts, seq_lens,
                                                               block_tables, every_chunk)
    arrays = StepArrays(np.asarray(input_ids, dtype=np.int64), positions, slot_mapping,
                        query_start_loc, seq_lens, block_tables)
    input_ids, positions, attn, logits_indices = batch_tensors(
        arrays, logits_indices, block_size, sliding_window, backend)
    return InputBatch(
        input_ids=input_ids, positions=positions, attn=attn,
        logits_indices=logits_indices, sampling_states=sampling_states,
        query_start_loc=query_start_loc, seq_lens=seq_lens,
        lora_ids=[s.lora_id for s in states], scheduled_states=states,
        request_start_loc=request_start_loc, arrays=arrays)


def batch_tensors(arrays: StepArrays, logits_indices: list[int], block_size: int,
                  sliding_window: int | None, backend: AttentionBackend):
    """(input_ids, positions, AttentionContext, logits_indices) on the backend's device
    from the host arrays: rank 0 and, from the broadcast arrays, every other
    tensor-parallel rank (worker/distributed/step_channel.py) build the same plan here."""
    device = backend.device
    qsl, seq_lens, block_tables = arrays.query_start_loc, arrays.seq_lens, arrays.block_tables
    if backend.is_triton:
        plan = make_ragged_plan(qsl, seq_lens, block_tables, device,
                                backend.num_kv_heads, sliding_window, backend.num_sms)
    else:
        plan = make_plan(qsl, seq_lens, torch.from_numpy(block_tables),
                         block_size, sliding_window, backend.name == NATIVE_CPU,
                         backend.native_prefill, backend.per_token_rows,
                         backend.decode_v_pass)
        if device.type != "cpu":
            plan = plan.to(device)
    if device.type == "cpu":
        input_ids, positions, slot_mapping, logits_indices = (
            torch.from_numpy(arrays.input_ids), torch.from_numpy(arrays.positions),
            torch.from_numpy(arrays.slot_mapping),
            torch.tensor(logits_indices, dtype=torch.int64))
    else:  # one host-to-device copy for every token-level array
        input_ids, positions, slot_mapping, logits_indices = pack_aligned(
            [arrays.input_ids, arrays.positions, arrays.slot_mapping, logits_indices],
            np.int64, device)
    return (input_ids, positions, AttentionContext(slot_mapping=slot_mapping, plan=plan),
            logits_indices)
