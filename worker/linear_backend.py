"""Kernel choice by measurement: the fastest linear path per weight shape and row count.

At load, every path that can run a layer (worker/models/linear_paths.py: torch native,
Folio's 16-bit kernel, widening, the quantized kernels' int8 route) is timed on the
model's own weights at each row bucket (1, 4, 16, 64, 256 rows), and each layer gets
the fastest as its :class:`LinearChoice`. Small buckets stream through all of a shape's
weights, as a decode step does (so the timing includes reading them from memory);
large ones are compute-bound and use two. Each path's time is the median of its calls;
a path already 4x slower than the best after a call stops early, and none runs past
``_PATH_BUDGET_S`` per bucket.

The table is cached as JSON under the weight cache's folder (``$FOLIO_CACHE_DIR``,
``off`` disables it) in ``linear_backend/``, one file per CPU model + flags, torch
version, thread count and kernel build, so later starts skip the timing.
``worker.linear_backend`` other than ``auto`` forces one path wherever it applies.
"""
from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from kernels import cpu_extension
from observability.logging import get_logger
from worker.models.linear import Linear
from worker.models.linear_paths import (ROW_BUCKETS, LinearChoice, candidates, run_path,
                                        weight_kind)
from worker.models.quant_linear import QuantLinear
from worker.weight_cache import WeightCache

log = get_logger(__name__)

TABLE_VERSION = 1
_PATH_BUDGET_S = 0.03   # at most this long per (shape, bucket, path), beyond 2 calls
_STREAM_MAX_ROWS = 16   # buckets up to this many rows cycle through every weight
_GIVE_UP_FACTOR = 4.0


def shape_key(weight) -> str:
    """``kind:out:in``, e.g. ``q4_1:960:576`` or ``bfloat16:576:1536``."""
    n, k = weight.shape
    return f"{weight_kind(weight)}:{n}:{k}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table_path() -> Path | None:
    """This machine's cache file, or None when the cache is switched off."""
    cache = WeightCache.from_env()
    if cache is None:
        return None
    key = "|".join([cpu_model(), cpu_extension.cpu_flags(), torch.__version__,
                    str(torch.get_num_threads()), cpu_extension.build_id(),
                    str(TABLE_VERSION)])
    return cache.directory / "linear_backend" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def linear_weights(model: nn.Module) -> list[tuple[object, str, object]]:
    """(owner, choice attribute, weight) of every linear layer and the LM head."""
    layers = [(m, "choice", m.weight) for m in model.modules()
              if isinstance(m, (Linear, QuantLinear))]
    head = model.head_weight
    if head is None:
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    layers.append((model, "head_choice", head))
    return layers


@torch.inference_mode()
def time_paths(weights: list, paths: tuple[str, ...], dtype: torch.dtype) -> dict[str, list]:
    """Median seconds per call of each path at each row bucket (None: gave up early)."""
    k = weights[0].shape[1]
    out = {p: [] for p in paths}
    for rows in ROW_BUCKETS:
        ws = weights if rows <= _STREAM_MAX_ROWS else weights[:2]
        x = torch.randn(rows, k).to(dtype)
        best = float("inf")
        for path in paths:
            t0 = time.perf_counter()
            run_path(path, x, ws[-1], None)  # warm-up (allocations, first touch)
            if time.perf_counter() - t0 > _GIVE_UP_FACTOR * 4 * best:
                out[path].append(None)  # hopeless even allowing for a cold first call
                continue
            calls, started = [], time.perf_counter()
            for i in range(max(2, len(ws))):
                t0 = time.perf_counter()
                run_path(path, x, ws[i % len(ws)], None)
                calls.append(time.perf_counter() - t0)
                if calls[-1] > _GIVE_UP_FACTOR * best or (
                        len(calls) >= 2 and time.perf_counter() - started > _PATH_BUDGET_S):
                    break
            median = statistics.median(calls)
            out[path].append(None if median > _GIVE_UP_FACTOR * best else median)
            best = min(best, median)
    return out


def fastest(timings: dict[str, list]) -> list[str]:
    """The path with the least time at each bucket."""
    paths = list(timings)
    return [min(paths, key=lambda p: timings[p][i] if timings[p][i] is not None else float("inf"))
            for i in range(len(ROW_BUCKETS))]


def _read_table(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get("entries", {})
    except (OSError, ValueError):
        return {}


def _write_table(path: Path | None, entries: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps({"cpu": cpu_model(), "torch": torch.__version__,
                                   "threads": torch.get_num_threads(),
                                   "buckets": ROW_BUCKETS, "entries": entries}, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("linear backend table not cached", path=str(path), reason=str(exc))


def choose_linear_backends(model: nn.Module, backend: str = "auto") -> dict[str, list[str]]:
    """Give every linear layer of ``model`` (and its LM head) a LinearChoice; returns
    the table, shape key -> path per row bucket, and logs it."""
    started = time.perf_counter()
    layers = linear_weights(model)
    by_key: dict[str, list] = {}
    for _, _, weight in layers:
        by_key.setdefault(shape_key(weight), []).append(weight)
    table, source = {}, "forced"
    if backend != "auto":
        for key, ws in by_key.items():
            options = candidates(ws[0])
            table[key] = [backend if backend in options else options[0]] * len(ROW_BUCKETS)
    else:
        path = table_path()
        cached = _read_table(path)
        table = {key: cached[key] for key in by_key if key in cached}
        dtype = model.norm.weight.dtype
        for key, ws in by_key.items():
            if key not in table:
                options = candidates(ws[0])
                table[key] = (fastest(time_paths(ws, options, dtype)) if len(options) > 1
                              else [options[0]] * len(ROW_BUCKETS))
        source = "cached" if len(table) == len(cached.keys() & table.keys()) else "measured"
        if source == "measured":
            _write_table(path, {**cached, **table})
    for owner, attr, weight in layers:
        setattr(owner, attr, LinearChoice(tuple(table[shape_key(weight)])))
    log.info("linear backends", source=source, buckets=list(ROW_BUCKETS),
             table={key: ",".join(paths) for key, paths in table.items()},
             seconds=round(time.perf_counter() - started, 2))
    return table
