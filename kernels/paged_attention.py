"""Attention over a flat, ragged batch whose keys and values live in a paged KV cache.

The batch mixes requests of two shapes, ordered decodes first::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      query_start_loc = [0,1,2,3,7,9]
              decodes    prefill chunk  chunk
    request r owns queries query_start_loc[r]:query_start_loc[r+1]; its keys are the
    seq_lens[r] tokens at positions 0..seq_lens[r]-1, found through block_tables[r]:
    position p sits in slot block_tables[r][p // block_size] * block_size + p % block_size.

Query i of request r is at position seq_lens[r] - query_len + i and sees keys at
positions up to its own (causal), and, with a sliding window W, only the last W of them.
The current step's keys must already be written into the cache (reshape_and_cache).

``PagedAttentionPlan`` holds what the reference derives from the batch once per step
(gather indices and masks), so each layer only gathers and multiplies. On CUDA the plan
carries ``RaggedAttentionMetadata`` instead: the batch as device tensors, read in place
by the Triton kernel (kernels/triton_paged_attention.py), with no per-step host work
beyond one copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.kv_quant import load_kv, round_through_cache
from kernels.split_kv import choose_num_splits


@dataclass(slots=True)
class PrefillSegment:
    """One request with more than one query token: its token range and key source."""

    start: int  # first query token in the flat batch
    end: int
    seq_len: int
    key_slots: torch.Tensor | None  # [seq_len] slots to gather; None: keys are this step's
    mask: torch.Tensor | None  # [q_len, seq_len] bool, True = attend; None: plain causal


@dataclass(slots=True)
class RaggedAttentionMetadata:
    """The batch as the Triton kernel reads it: integer tensors on the cache's device."""

    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int  # picks the tile shape only
    num_splits: int = 1  # split-KV parts (1: none)


@dataclass(slots=True)
class FreshPrefills:
    """A step's prefill segments split for the native prefill kernel, once per step: the
    fresh ones (keys all this step's, plain causal) as its int64 starts and lengths, the
    rest for SDPA."""

    starts: torch.Tensor  # [fresh segments] int64
    lens: torch.Tensor
    rest: list[PrefillSegment]


@dataclass(slots=True)
class PagedAttentionPlan:
    """Per-step attention plan, derived once and shared by every layer.

    Decodes run either the native kernel (block tables read in place) or the torch
    reference (padded gather indices and mask); prefill segments run SDPA, except that
    with ``fresh`` the fresh ones run the native prefill kernel.
    """

    num_decodes: int
    decode_slots: torch.Tensor | None  # reference: [num_decodes, max_len] (padded: slot 0)
    decode_mask: torch.Tensor | None  # reference: [num_decodes, 1, 1, max_len], True = attend
    prefills: list[PrefillSegment]
    decode_block_tables: torch.Tensor | None = None  # native: [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # native: [num_decodes]
    sliding_window: int | None = None
    ragged: RaggedAttentionMetadata | None = None  # Triton: everything runs in one kernel
    native: bool = False  # the native CPU kernels run this step's attention
    fresh: FreshPrefills | None = None  # native, native_prefill: the fresh segments, the rest
    batch_invariant: bool = False  # native: rows' results may not depend on the batch
    decode_v_pass: str = "widened"  # native: the decode kernel's V pass (bf16)

    def to(self, device: torch.device) -> "PagedAttentionPlan":
        """The reference's tensors moved to ``device`` (the torch backend on a GPU)."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)
        prefills = [PrefillSegment(p.start, p.end, p.seq_len, move(p.key_slots), move(p.mask))
                    for p in self.prefills]
        return PagedAttentionPlan(self.num_decodes, move(self.decode_slots),
                                  move(self.decode_mask), prefills,
                                  move(self.decode_block_tables), move(self.decode_seq_lens),
                                  self.sliding_window, self.ragged, self.native, self.fresh,
                                  self.batch_invariant, self.decode_v_pass)


def _positions_to_slots(block_table: torch.Tensor, positions: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    blocks = torch.gather(block_table, -1, positions // block_size)
    return blocks * block_size + positions % block_size


def make_plan(query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor,
              block_size: int, sliding_window: int | None = None,
              use_native_decode: bool = False, native_prefill: bool = False,
              batch_invariant: bool = False,
              decode_v_pass: str = "widened") -> PagedAttentionPlan:
    """Derive the step's plan for a batch ordered decodes first.

    ``use_native_decode`` hands decodes to the native CPU kernel, and with
    ``native_prefill`` (worker.prefill_attention: native) fresh prompt segments to the
    native one (see kernels/cpu_paged_attention.py); the caller checks that they are
    available and that the kernel's contract holds (bf16, head_dim 64 or 128). ``batch_invariant``
    (deterministic mode) keeps the native kernel's work split from depending on the batch;
    ``decode_v_pass`` is the native decode kernel's V pass (worker/decode_v_pass.py).
    """
    num_reqs = len(seq_lens)
    query_lens = [query_start_loc[r + 1] - query_start_loc[r] for r in range(num_reqs)]
    num_decodes = 0
    while num_decodes < num_reqs and query_lens[num_decodes] == 1:
        num_decodes += 1
    decode_slots = decode_mask = decode_tables = decode_lens = None
    if num_decodes and use_native_decode:
        decode_tables = block_tables[:num_decodes].contiguous()
        decode_lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.int64)
    elif num_decodes:
        lens = torch.tensor(seq_lens[:num_decodes])
        max_len = int(lens.max())
        pos = torch.arange(max_len).expand(num_decodes, max_len)
        visible = pos < lens[:, None]
        if sliding_window is not None:
            visible &= pos > (lens[:, None] - 1 - sliding_window)
        pos = torch.where(visible, pos, 0)
        decode_slots = _positions_to_slots(block_tables[:num_decodes], pos, block_size)
        decode_mask = visible[:, None, None, :]
    prefills = []
    for r in range(num_decodes, num_reqs):
        start, end, seq_len = query_start_loc[r], query_start_loc[r + 1], seq_lens[r]
        q_len = end - start
        context_len = seq_len - q_len
        key_slots = None
        if context_len > 0:
            key_slots = _positions_to_slots(block_tables[r], torch.arange(seq_len), block_size)
        mask = None
        if context_len > 0 or sliding_window is not None:
            q_pos = torch.arange(context_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        prefills.append(PrefillSegment(start, end, seq_len, key_slots, mask))
    fresh = None
    if use_native_decode and native_prefill:
        own, rest = [], []  # keys all this step's and plain causal, or not
        for p in prefills:
            (own if p.key_slots is None and p.mask is None else rest).append(p)
        if own:
            fresh = FreshPrefills(
                torch.tensor([p.start for p in own], dtype=torch.int64),
                torch.tensor([p.end - p.start for p in own], dtype=torch.int64), rest)
    return PagedAttentionPlan(num_decodes, decode_slots, decode_mask, prefills,
                              decode_tables, decode_lens, sliding_window,
                              native=use_native_decode, fresh=fresh,
                              batch_invariant=batch_invariant, decode_v_pass=decode_v_pass)


def pack_aligned(parts: list, dtype, device: torch.device) -> list[torch.Tensor]:
    """1-D integer arrays (or lists) as ``dtype`` tensors on ``device``: views of one
    tensor filled by one host-to-device copy.

    Each part starts 16-byte aligned, as a fresh allocation would: Triton specialises
    kernels on pointer alignment, so unaligned views would compile extra variants.
    """
    per_16 = 16 // np.dtype(dtype).itemsize
    sizes = [len(p) for p in parts]
    starts = np.cumsum([0] + [-(-n // per_16) * per_16 for n in sizes])
    packed = np.zeros(int(starts[-1]), dtype=dtype)
    for start, n, part in zip(starts, sizes, parts):
        packed[start:start + n] = part
    on_device = torch.from_numpy(packed)
    if device.type != "cpu":
        on_device = on_device.to(device, non_blocking=True)
    return [on_device[start:start + n] for start, n in zip(starts, sizes)]


def make_ragged_plan(query_start_loc: list[int], seq_lens: list[int],
                     block_tables: np.ndarray, device: torch.device, num_kv_heads: int,
                     sliding_window: int | None = None,
                     num_sms: int | None = None) -> PagedAttentionPlan:
    """The Triton kernel's plan: the batch packed into one int32 host-to-device copy.

    ``num_sms`` (the GPU's multiprocessor count) enables split-KV for decode-only
    batches that would not fill the GPU; None never splits.
    """
    num_reqs, width = block_tables.shape
    qsl, lens, tables = pack_aligned([query_start_loc, seq_lens, block_tables.reshape(-1)],
                                     np.int32, device)
    max_query_len = max(b - a for a, b in zip(query_start_loc, query_start_loc[1:]))
    num_splits = 1
    if num_sms is not None:
        num_splits = choose_num_splits(num_reqs, num_kv_heads, max_query_len, max(seq_lens),
                                       num_sms)
    meta = RaggedAttentionMetadata(qsl, lens, tables.view(num_reqs, width), max_query_len,
                                   num_splits)
    num_decodes = sum(1 for a, b in zip(query_start_loc, query_start_loc[1:]) if b - a == 1)
    return PagedAttentionPlan(num_decodes, None, None, [], sliding_window=sliding_window,
                              ragged=meta)


def _load(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows at ``slots`` as ``dtype`` values (widened from fp8, int8 times scale)."""
    return load_kv(flat.index_select(0, slots), dtype)


def _decode_attention(query, k_flat, v_flat, plan, scale):
    # Every query head of a KV head's group sees the same keys under the same mask, so
    # the group folds into the query-length axis: q [D, kvh, group, hd] against keys
    # [D, kvh, L, hd]. That is exact, and about twice as fast as SDPA's own GQA path.
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = k_flat.shape[1]
    slots = plan.decode_slots
    shape = (num_decodes, slots.shape[1], num_kv_heads, head_dim)
    keys = _load(k_flat, slots.view(-1), query.dtype).view(shape).transpose(1, 2)
    values = _load(v_flat, slots.view(-1), query.dtype).view(shape).transpose(1, 2)
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.decode_mask,
                                         scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(query, key, value, k_flat, v_flat, seg, scale):
    # SDPA takes its fused CPU kernel only for 4-D inputs ([1, heads, len, hd]); 3-D
    # inputs fall back to a path measured 7-10x slower here.
    q = query[seg.start:seg.end].transpose(0, 1).unsqueeze(0)
    if seg.key_slots is None:  # as the cache holds them (kernels/kv_quant.py)
        k = round_through_cache(key[seg.start:seg.end], k_flat.dtype)
        v = round_through_cache(value[seg.start:seg.end], v_flat.dtype)
    else:
        k = _load(k_flat, seg.key_slots, query.dtype)
        v = _load(v_flat, seg.key_slots, query.dtype)
    out = F.scaled_dot_product_attention(q, k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=seg.mask,
                                         scale=scale, is_causal=seg.mask is None,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _flat(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    return flat[0], flat[1]


def _prefills_into(out, query, key, value, kv_cache, plan, scale,
                   segments: list[PrefillSegment] | None = None) -> torch.Tensor:
    """``segments`` (default: all of the plan's prefills) through torch SDPA into out."""
    k_flat, v_flat = _flat(kv_cache)
    for seg in plan.prefills if segments is None else segments:
        out[seg.start:seg.end] = _prefill_attention(query, key, value, k_flat, v_flat, seg,
                                                    scale)
    return out


def paged_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              kv_cache: torch.Tensor, plan: PagedAttentionPlan,
                              scale: float) -> torch.Tensor:
    """The spec. ``query`` ``[T, H, hd]``; ``key``/``value`` ``[T, kvh, hd]`` are this
    step's (already in the cache too). Returns ``[T, H, hd]``."""
    out = torch.empty_like(query)
    if plan.num_decodes:
        k_flat, v_flat = _flat(kv_cache)
        out[:plan.num_decodes] = _decode_attention(query[:plan.num_decodes], k_flat, v_flat,
                                                   plan, scale)
    return _prefills_into(out, query, key, value, kv_cache, plan, scale)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, plan: PagedAttentionPlan,
                    scale: float) -> torch.Tensor:
    """Public entry point. A plan with ``ragged`` metadata runs the Triton kernel (the
    whole batch at once); otherwise decodes go through the native CPU kernel when the
    plan says so, and prefill segments (and every decode otherwise) through the torch
    reference."""
    if plan.ragged is not None:
        # Triton is imported by the GPU path only: a CPU worker never loads it (~70 MB)
        from kernels.triton_paged_attention import ragged_paged_attention
        m = plan.ragged
        return ragged_paged_attention(query, kv_cache, m.block_tables, m.seq_lens,
                                      m.query_start_loc, m.max_query_len, scale,
                                      plan.sliding_window, m.num_splits)
    if not plan.native:
        return paged_attention_reference(query, key, value, kv_cache, plan, scale)
    out = torch.empty_like(query)
    if plan.num_decodes:
        from kernels.cpu_paged_attention import paged_attention_decode
        decoded = paged_attention_decode(query[:plan.num_decodes], kv_cache,
                                         plan.decode_block_tables, plan.decode_seq_lens,
                                         scale, plan.sliding_window, plan.batch_invariant,
                                         plan.decode_v_pass)
        if not plan.prefills:
            return decoded
        out[:plan.num_decodes] = decoded
    return _native_prefills_into(out, query, key, value, kv_cache, plan, scale)


def _native_prefills_into(out, query, key, value, kv_cache, plan, scale) -> torch.Tensor:
    """The prefill segments on the CPU: with ``plan.fresh``, the fresh ones through the native
    kernel in one call and the rest (continued prompts, masks) through SDPA."""
    head_dim = query.shape[-1]
    if plan.fresh is None or any(t.stride(1) != head_dim or t.stride(2) != 1
                               for t in (query, key, value)):
        return _prefills_into(out, query, key, value, kv_cache, plan, scale)
    from kernels import cpu_paged_attention as native
    native.prefill_attention(query, key, value, plan.fresh.starts, plan.fresh.lens, scale, out)
    return _prefills_into(out, query, key, value, kv_cache, plan, scale, plan.fresh.rest)
