"""Kernel choice by measurement: the fastest linear path per weight shape and row count.

At load, every path that can run a layer exactly (worker/models/linear_paths.py: torch
native, Folio's 16-bit and AMX tile kernels, widening, oneDNN on a prepacked bf16
weight; not the quantized kernels' int8 route, which quantizes activations and changed
the default model's greedy answers) is timed on the model's own weights at each row
bucket (1, 4, 16, 64, 256 rows), and each layer gets the fastest as its
:class:`LinearChoice`.
Buckets up to 64 rows (decode batches) stream through all of a shape's weights, as a
decode step does (so the timing includes reading them from memory; timed on one hot
weight, the 64-row bucket had preferred a path that was slower in real steps); the
prefill bucket is compute-bound and uses one. The paths take turns, three passes each, and
the best pass counts; a path 4x slower than the best after a full pass is dropped early
(its first pass is a single warm-up call, which alone never drops it), and another path
must beat the default by 10% to replace it.

The table is cached as JSON under the weight cache's folder (``$FOLIO_CACHE_DIR``,
``off`` disables it) in ``linear_backend/``, one file per CPU model + flags, torch
version, thread count and kernel build, so later starts skip the timing; a table timed
while the machine was busy (load above its CPU count) is used but not cached.
``worker.linear_backend`` other than ``auto`` forces one path wherever it applies
(``int8`` is the way to run the int8 route).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

from kernels import cpu_extension
from observability.logging import get_logger
from worker.models import prepacked
from worker.models.linear import Linear
from worker.models.linear_paths import (MKLDNN, ROW_BUCKETS, LinearChoice, candidates,
                                        path_max_rows, run_path, weight_kind)
from worker.models.quant_linear import QuantLinear
from worker.weight_cache import WeightCache

log = get_logger(__name__)

# 2: int8 no longer measured (tables of 1 may hold it); 3: mkldnn; 4: int16; 5: amx for
# bf16 weights
TABLE_VERSION = 5
_ROUNDS = 3             # passes per path and bucket, taken in turn; the best counts
_STREAM_MAX_ROWS = 64   # buckets up to this many rows pass over every weight of a shape
_GIVE_UP_FACTOR = 4.0   # a path this much slower than the best so far is dropped
_MARGIN = 0.1           # another path must beat the default by 10% to be chosen
_HEAD_MAX_ROWS = 64     # the LM head sees sampled rows only: larger buckets copy this one
_BUDGET_S = 3.0         # shapes left when this is spent keep their default path


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


def _pass_seconds(path: str, x: torch.Tensor, weights: list) -> float:
    """Seconds per call of one pass of ``path`` over ``weights``."""
    t0 = time.perf_counter()
    for w in weights:
        run_path(path, x, w, None)
    return (time.perf_counter() - t0) / len(weights)


@torch.inference_mode()
def time_paths(weights: list, paths: tuple[str, ...], dtype: torch.dtype,
               max_rows: int = ROW_BUCKETS[-1]) -> dict[str, list]:
    """Seconds per call of each path at each row bucket up to ``max_rows`` (None: gave
    up on it; larger buckets repeat the last), the best of ``_ROUNDS`` passes taken in
    turn, so that a burst of load elsewhere on a shared machine hits every path alike.
    The path in the lead is never dropped, so every bucket keeps at least one time; a
    path is not timed past its ``path_max_rows``."""
    k = weights[0].shape[1]
    out = {p: [] for p in paths}
    floor = dict.fromkeys(paths, 0.0)  # a path's time only grows with rows
    limits = {p: path_max_rows(p, weights[0]) for p in paths}
    for rows in ROW_BUCKETS:
        if rows > max_rows:
            for path in paths:
                out[path].append(out[path][-1])
            continue
        ws = weights if rows <= _STREAM_MAX_ROWS else weights[:1]
        x = torch.randn(rows, k).to(dtype)
        best = dict.fromkeys(paths, float("inf"))
        live = [p for p in paths if limits[p] is None or rows <= limits[p]]
        for round_ in range(_ROUNDS):
            for path in list(live):
                lead = min(best.values())
                if best[path] > lead and floor[path] > _GIVE_UP_FACTOR * lead:
                    live.remove(path)  # slower at fewer rows than the best is here
                    continue
                # the first round's pass is one warm-up call (allocations, first touch)
                best[path] = min(best[path], _pass_seconds(path, x, ws[:1] if round_ == 0 else ws))
                # hopeless, even allowing for noise; never on the warm-up call alone, whose
                # first touches had once made AMX look 4x slower than widening and lose
                if round_ > 0 and best[path] > _GIVE_UP_FACTOR * min(best.values()):
                    live.remove(path)
        for path in paths:
            out[path].append(best[path] if path in live else None)
            if best[path] != float("inf"):
                floor[path] = max(floor[path], best[path])
    return out


def fastest(timings: dict[str, list]) -> list[str]:
    """Per bucket, the first path (the default) unless another is faster by more than
    ``_MARGIN``: timing noise on a busy machine must not flip a choice."""
    paths = list(timings)
    chosen = []
    for i in range(len(ROW_BUCKETS)):
        times = {p: timings[p][i] for p in paths if timings[p][i] is not None}
        best = min(times, key=times.get)
        keep = paths[0] in times and times[paths[0]] <= (1 + _MARGIN) * times[best]
        chosen.append(paths[0] if keep else best)
    return chosen


def read_table(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text()).get("entries", {})
    except (OSError, ValueError):
        return {}


def machine_is_busy() -> bool:
    """More runnable processes than CPUs over the last minute: timings are suspect."""
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def write_table(path: Path | None, entries: dict) -> None:
    if path is None:
        return
    if machine_is_busy():
        log.info("linear backend table not cached: the machine is busy, measure again "
                 "next start", load_average=round(os.getloadavg()[0], 2))
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


def _measure(weights: list, dtype: torch.dtype, max_rows: int) -> list[str]:
    """The fastest path per bucket for one shape."""
    options = candidates(weights[0], lossy=False, dtype=dtype)
    if len(options) == 1:
        return [options[0]] * len(ROW_BUCKETS)
    if MKLDNN in options:  # packed before the timing: a pass that packs is 4x slower
        for weight in weights:
            prepacked.packed(weight)
    return fastest(time_paths(weights, options, dtype, max_rows))


def keep_packed(layers: list, table: dict[str, list[str]]) -> None:
    """Weights whose layer runs the ``mkldnn`` path at some row count get their packed
    copy now (not in the first request); the timing's copies of the others go."""
    wanted = {id(w) for _, _, w in layers if MKLDNN in table[shape_key(w)]}
    for _, _, weight in layers:
        if id(weight) in wanted:
            prepacked.packed(weight)
        else:
            prepacked.drop(weight)


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
        cached = read_table(path)
        table = {key: cached[key] for key in by_key if key in cached}
        source = "cached" if len(table) == len(by_key) else "measured"
        head_key, skipped = shape_key(layers[-1][2]), []
        for key, ws in by_key.items():
            if key in table:
                continue
            if time.perf_counter() - started > _BUDGET_S:  # defaults, not cached
                table[key] = [candidates(ws[0], lossy=False)[0]] * len(ROW_BUCKETS)
                skipped.append(key)
                continue
            table[key] = _measure(ws, model.norm.weight.dtype,
                                  _HEAD_MAX_ROWS if key == head_key else ROW_BUCKETS[-1])
        if source == "measured":
            write_table(path, {**cached, **{k: v for k, v in table.items()
                                             if k not in skipped}})
        if skipped:
            log.info("linear backends past the time budget keep their defaults",
                     shapes=skipped, budget_s=_BUDGET_S)
    for owner, attr, weight in layers:
        setattr(owner, attr, LinearChoice(tuple(table[shape_key(weight)])))
    keep_packed(layers, table)
    log.info("linear backends", source=source, buckets=list(ROW_BUCKETS),
             table={key: ",".join(paths) for key, paths in table.items()},
             seconds=round(time.perf_counter() - started, 2))
    return table
