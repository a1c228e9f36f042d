"""The native decode attention kernel's V pass: configured, or chosen by measurement.

With bf16 activations and a bf16 KV cache, on a CPU with AVX512-BF16, the decode kernel
(``kernels/csrc/paged_attention_decode.cpp``) can add up its probability-weighted value
rows two keys at a time with ``vdpbf16ps``, the probabilities rounded to bf16
("paired"), instead of widening the rows to float32 for FMAs ("widened", the default).
On the AVX-512 Zen 4 it was written on, the paired pass made a layer call 1.05-1.24x as
fast with the keys and values in cache; on an AMX Xeon an earlier trial of it was no
faster, because ``vdpbf16ps`` retires there at half the FMA rate. The rounding is not
free: on the default model (bf16) 13 of 23 prompts' 64 greedy tokens changed, against 1
of 23 between two runs of the widened pass. So ``worker.decode_v_pass`` is ``widened``
unless the operator asks: ``paired`` takes it where it is built, and ``auto``, since a
flag cannot tell the two CPUs apart, times both on the model's own head shape with the
keys and values in cache (the arithmetic is what differs) and keeps the paired pass
only when it is faster by more than a margin.

The choice goes into the worker's AttentionBackend and from there into every step's
plan (the draft model of speculative decoding keeps the default). Under ``auto`` it is
cached beside the linear backend table (``worker/linear_backend.py``: per CPU, torch
version, thread count and kernel build), under the key
``decode_v_pass:<heads>:<kv heads>:<head dim>``.
"""
from __future__ import annotations

import time

import torch

from kernels import cpu_paged_attention
from observability.logging import get_logger
from worker.linear_backend import machine_is_busy, read_table, table_path, write_table

log = get_logger(__name__)

# (requests, keys each): one long row, and a batch at a middling context
_SHAPES = ((1, 2048), (32, 256))
_BLOCK_SIZE = 16
_ROUNDS = 5   # alternations of the passes; the best round of each counts
_CALLS = 4    # calls per shape in a round
_MARGIN = 0.05  # paired must be this much faster (its gain here: 1.1-1.2x)


def table_key(num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    return f"decode_v_pass:{num_heads}:{num_kv_heads}:{head_dim}"


def faster(seconds: dict[str, float]) -> str:
    """``widened`` unless ``paired`` is faster by more than the margin (timing noise must
    not flip the choice)."""
    if "paired" not in seconds:
        return "widened"
    return "paired" if seconds["paired"] * (1 + _MARGIN) < seconds["widened"] else "widened"


def _operands(batch: int, keys: int, num_heads: int, num_kv_heads: int, head_dim: int):
    """A bf16 decode batch with its blocks scattered over a cache of just its size."""
    gen = torch.Generator().manual_seed(0)
    per = -(-keys // _BLOCK_SIZE)
    num_blocks = batch * per
    cache = torch.randn(2, num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim,
                        generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per)
    query = torch.randn(batch, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    return query, cache, tables, torch.full((batch,), keys, dtype=torch.int64)


def measure(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, float]:
    """Seconds per round of every built V pass over ``_SHAPES``, the passes alternated
    and the best round of each kept."""
    operands = [_operands(b, k, num_heads, num_kv_heads, head_dim) for b, k in _SHAPES]
    scale = head_dim ** -0.5
    attend = cpu_paged_attention.paged_attention_decode
    best = {name: float("inf") for name in cpu_paged_attention.decode_v_passes()}
    for _ in range(_ROUNDS):
        for name in best:
            for q, cache, tables, lens in operands:  # warm: caches, pages, threads
                attend(q, cache, tables, lens, scale, v_pass=name)
            t0 = time.perf_counter()
            for q, cache, tables, lens in operands:
                for _ in range(_CALLS):
                    attend(q, cache, tables, lens, scale, v_pass=name)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def choose_decode_v_pass(configured: str, num_heads: int, num_kv_heads: int, head_dim: int,
                         deterministic: bool = False) -> str:
    """The decode kernel's V pass for a bf16 model with a bf16 cache on this machine
    under ``configured`` (worker.decode_v_pass), logged. ``paired`` is taken where it is
    built; ``auto`` comes from the cache, else is measured and cached. The two passes
    round differently, so under ``auto`` a choice that could differ from one start to
    the next is not made: deterministic mode, and a machine too busy to time on (which
    would also leave it uncached), keep the widened pass."""
    started = time.perf_counter()
    built = cpu_paged_attention.decode_v_passes()
    seconds: dict[str, float] = {}
    if len(built) == 1 or head_dim % 32:  # nothing to choose: the kernel widens
        choice, source = "widened", "only"
    elif configured != "auto":
        choice, source = configured, "configured"
    elif deterministic:
        choice, source = "widened", "deterministic"
    else:  # the table is read (and written) only here
        path, key = table_path(), table_key(num_heads, num_kv_heads, head_dim)
        table = read_table(path)
        if table.get(key) in built:
            choice, source = table[key], "cached"
        elif machine_is_busy():
            choice, source = "widened", "busy"
        else:
            seconds = measure(num_heads, num_kv_heads, head_dim)
            choice, source = faster(seconds), "measured"
            write_table(path, {**table, key: choice})
    log.info("decode attention V pass", choice=choice, source=source,
             **{f"{name}_ms": round(s * 1e3, 3) for name, s in seconds.items()},
             seconds=round(time.perf_counter() - started, 3))
    return choice
