"""Triton paged attention over a flat, ragged batch (the GPU backend of kernels.paged_attention).

One kernel serves prefill chunks (with cached context before them) and single-token
decodes alike. A program owns one *query tile*: up to ``BLOCK_Q`` consecutive query
tokens of one request, times the ``GROUP`` query heads that share one KV head. Both
are folded into the rows of one matrix, so the keys are loaded once per group (GQA)
and ``tl.dot`` sees at least 16 rows even for a single decode token::

    row r  ->  token  q_tile_start + r // GROUP,  query head  kv_head * GROUP + r % GROUP

    grid = (num_q_tiles, num_kv_heads, num_splits)

Tiles are numbered request after request without a host-side table: request ``r``'s
tiles start at ``query_start_loc[r] // BLOCK_Q + r`` (a monotone upper bound on the
tiles before it), and a program finds its request by binary search over that. Tiles
past a request's last query exit at once, so ``num_tokens // BLOCK_Q + num_reqs``
programs always suffice, whatever the mix: the grid depends on sizes only, which keeps
it fixed inside a CUDA graph.

Each program streams its request's keys in tiles of ``BLOCK_N`` positions, looking up
each position's block in the block table (so any block size works), with an online
softmax in float32 (base 2). Split-KV (flash decoding): with ``num_splits > 1`` the
key range is cut into that many parts, each program writes its part's normalised
output and log-sum-exp, and a second kernel merges the parts.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_quant import is_fp8



def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _key_tiles(first_q_pos, end_q_pos, split, SLIDING_WINDOW: tl.constexpr,
               BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Keys a query tile can see, [k_lo, k_hi), and this split's share of its tiles.

    The last query (position end_q_pos - 1) sees up to itself; with a window W the
    first one sees nothing before first_q_pos - W + 1. (a + b - 1) // b rather than
    tl.cdiv: device functions are slow in the interpreter.
    """
    k_hi = end_q_pos
    k_lo = 0
    if SLIDING_WINDOW > 0:
        k_lo = tl.maximum(first_q_pos - SLIDING_WINDOW + 1, 0)
    num_tiles = (k_hi - k_lo + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_begin = split * tiles_per_split
    return k_lo, k_hi, tile_begin, tl.minimum(tile_begin + tiles_per_split, num_tiles)


@triton.jit
def _store_tile(out_ptr, part_out_ptr, part_lse_ptr, acc, m_i, l_i, tok, head, row_ok, dims,
                dim_ok, split, stride_ot, stride_oh, num_heads, HEAD_DIM_PAD: tl.constexpr,
                NUM_SPLITS: tl.constexpr):
    """Normalise and write a tile's rows: the output itself, or with split-KV this
    split's partial output and log-sum-exp (base 2) for _merge_splits_kernel."""
    empty = l_i == 0.0  # padding rows, empty splits, seq_len 0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # partials: out [T, H, NUM_SPLITS, HEAD_DIM_PAD], lse [T, H, NUM_SPLITS]
        part = (tok * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], out,
                 mask=store_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


# num_reqs and the block-table width change from step to step: specialising on their
# values (== 1, multiple of 16) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def _ragged_paged_attention_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale_log2, num_reqs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot, stride_head,
        SLIDING_WINDOW: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The request: the largest r with query_start_loc[r] // BLOCK_Q + r <= q_tile.
    # (Inline, like the tile loop: the interpreter re-patches triton.language on every
    # device-function call, so helpers are only called once per program.)
    req = 0
    hi = num_reqs  # invariant: the answer lies in [req, hi)
    while hi - req > 1:
        mid = (req + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        req = tl.where(first_tile <= q_tile, mid, req)
        hi = tl.where(first_tile <= q_tile, hi, mid)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    q_tile_start = q_begin + (q_tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q_tile_start >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - (q_end - q_begin)  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_end)
    q_pos = context_len + tok - q_begin  # absolute position of each row's query
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter computes bf16 arithmetic wrongly
        q = q.to(tl.float32)

    first_q_pos = context_len + q_tile_start - q_begin
    end_q_pos = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_end) - q_begin
    k_lo, k_hi, tile_begin, tile_end = _key_tiles(first_q_pos, end_q_pos, split,
                                                  SLIDING_WINDOW, BLOCK_N, NUM_SPLITS)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    table = block_tables_ptr + req * stride_bt
    for t in range(tile_begin, tile_end):
        k_pos = k_lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < k_hi
        page = tl.load(table + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
        offs = ((page * PAGE + k_pos % PAGE) * stride_slot + kv_head * stride_head)[:, None] \
            + dims[None, :]
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if KV_FP8:  # a one-byte cache: widen to the queries' dtype (scale 1.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so
        # exp2 gives 0 rather than NaN (-inf - -inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    _store_tile(out_ptr, part_out_ptr, part_lse_ptr, acc, m_i, l_i, tok, head, row_ok, dims,
                dim_ok, split, stride_ot, stride_oh, tl.num_programs(1) * GROUP, HEAD_DIM_PAD,
                NUM_SPLITS)


@triton.jit
def _merge_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr):
    # One program per (token, query head): out = sum_s w_s * out_s / sum_s w_s with
    # w_s = 2^(lse_s - max lse); splits that saw no key have lse = -inf and weigh 0.
    tok = tl.program_id(0)
    head = tl.program_id(1)
    base = (tok * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(part_lse_ptr + base + splits)
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM_PAD + dims[None, :])
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def tile_shape(group: int, max_query_len: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)``: rows per program and query tokens per program.

    Decode-only batches need ``group`` rows per request (16 at least, for tl.dot);
    batches with prefill chunks take 64-row tiles so each key tile serves many queries.
    """
    rows = 16 if max_query_len == 1 else 64
    rows = max(rows, triton.next_power_of_2(group))
    return rows, rows // group


def ragged_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                           sliding_window: int | None = None, num_splits: int = 1,
                           block_n: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[T, H, hd]`` over the paged cache; returns ``[T, H, hd]``.

    ``kv_cache`` contiguous ``[2, num_blocks, block_size, kvh, hd]`` already holding this
    step's keys; ``block_tables`` ``[R, max_blocks]``, ``seq_lens`` ``[R]`` and
    ``query_start_loc`` ``[R + 1]`` integer tensors on the cache's device (CUDA, or CPU
    under ``TRITON_INTERPRET=1``). ``max_query_len`` only picks the tile shape: any
    value is correct, the true one is fastest. Requests with no query rows are skipped;
    a query that sees no key (seq_len 0, CUDA-graph padding) gets zeros. ``block_n``:
    keys per tile (a power of two, 16 at least; None: 64, or 32 for float32 queries,
    whose tiles take twice the shared memory). An fp8 cache (memory.kv_cache_dtype) is
    widened to the queries' dtype as it is loaded.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.is_contiguous() and query.stride(2) == 1
    assert kv_cache.dtype != torch.int8, "the Triton kernel reads no int8 KV cache"
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if block_n is None:
        block_n = 32 if query.dtype == torch.float32 else 64
    assert num_splits & (num_splits - 1) == 0 and block_n >= 16
    block_m, block_q = tile_shape(group, max_query_len)
    head_dim_pad = triton.next_power_of_2(head_dim)
    part_out = part_lse = out  # unused placeholders when not splitting
    if num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
    upcast = _interpreting() and query.dtype == torch.bfloat16
    precision = "ieee" if query.dtype == torch.float32 or upcast else "tf32"
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    _ragged_paged_attention_kernel[grid](
        out, part_out, part_lse, query, kv_cache[0], kv_cache[1],
        block_tables, seq_lens, query_start_loc, scale * 1.4426950408889634, num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), num_kv_heads * head_dim, head_dim,
        SLIDING_WINDOW=sliding_window or 0, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, PAGE=block_size, NUM_SPLITS=num_splits, UPCAST=upcast,
        DOT_PRECISION=precision, KV_FP8=is_fp8(kv_cache.dtype), num_warps=4)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, num_warps=1)
    return out
