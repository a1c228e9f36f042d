"""bf16 linear layers at decode row counts: Folio's AMX tile kernel against oneDNN.

Loads the default model (or ``--model``) with bf16 weights, as the worker holds them,
and times one pass over all of its weights of each shape (q/k/v, o, gate/up, down, the
LM head), so that the weights stream from memory as in a decode step, through each
path that runs them here: ``amx`` (kernels/csrc/amx_linear.cpp, the weight as stored),
``mkldnn`` (oneDNN on its prepacked copy), ``native`` (torch ``F.linear``) and
``kernel`` (Folio's 16-bit widening kernel). The paths take turns, ``--rounds`` passes
each, the best counts. Prints microseconds per weight, the read rate, and amx / mkldnn,
with the CPU model and flags.

    .venv/bin/python benchmarks/amx_linear.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_facts, memory_bandwidth_gb_s  # noqa: E402


def weights_by_shape(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    from worker.linear_backend import linear_weights
    shapes: dict[tuple[int, int], list[torch.Tensor]] = {}
    for _, _, w in linear_weights(model):
        shapes.setdefault(tuple(w.shape), []).append(w)
    return shapes


@torch.inference_mode()
def pass_seconds(path: str, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    from worker.models.linear_paths import run_path
    t0 = time.perf_counter()
    for w in weights:
        run_path(path, x, w, None)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from folio import LLM
    from worker.models import prepacked
    from worker.models.linear_paths import AMX, KERNEL, MKLDNN, NATIVE, candidates
    llm = LLM(model=args.model, dtype="bfloat16", quantization="none",
              num_threads=args.threads, kv_cache_bytes=64 * 2 ** 20,
              **{"observability.log_level": "warning"})
    shapes = weights_by_shape(llm.runner.model)
    first = next(iter(shapes.values()))[0]
    if AMX not in candidates(first, lossy=False, dtype=torch.bfloat16):
        sys.exit("the AMX tile kernel does not run here (no AMX-BF16, or the kernels are off)")
    bandwidth = memory_bandwidth_gb_s()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({args.threads} threads)")
    rows_out = []
    totals: dict[int, dict[str, float]] = {}
    counts: dict[str, int] = {}  # (shape, rows) cells each path ran
    for (n, k), ws in shapes.items():
        paths = [p for p in (AMX, MKLDNN, NATIVE, KERNEL)
                 if p in candidates(ws[0], lossy=False, dtype=torch.bfloat16)]
        if MKLDNN in paths:
            for w in ws:
                prepacked.packed(w)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            best = dict.fromkeys(paths, float("inf"))
            for p in paths:  # warm-up: first calls, primitive creation
                pass_seconds(p, x, ws[:1])
            for _ in range(args.rounds):
                for p in paths:
                    best[p] = min(best[p], pass_seconds(p, x, ws))
            row = {"out": n, "in": k, "weights": len(ws), "rows": rows,
                   "us_per_weight": {p: best[p] / len(ws) * 1e6 for p in paths},
                   "gb_s": {p: nbytes / best[p] / 1e9 for p in paths}}
            if MKLDNN in best:
                row["amx_over_mkldnn"] = best[AMX] / best[MKLDNN]
            rows_out.append(row)
            for p in paths:
                totals.setdefault(rows, {}).setdefault(p, 0.0)
                totals[rows][p] += best[p]
                counts[p] = counts.get(p, 0) + 1
            rates = "  ".join(f"{p} {best[p] / len(ws) * 1e6:7.1f} us "
                              f"{nbytes / best[p] / 1e9:5.1f} GB/s" for p in paths)
            ratio = f"  amx/mkldnn {row['amx_over_mkldnn']:.2f}" if MKLDNN in best else ""
            print(f"[{n:5d} x {k:4d}] x{len(ws):2d} rows {rows:3d}: {rates}{ratio}")
    print("all linear layers, ms per pass:")
    for rows, per in totals.items():
        print(f"  rows {rows:3d}: " + "  ".join(f"{p} {t * 1e3:.2f}" for p, t in per.items()
                                               if counts[p] == len(shapes) * len(args.rows)))
    if args.json:
        args.json.write_text(json.dumps({
            "machine": machine_facts(), "read_bandwidth_gb_s": bandwidth,
            "model": args.model, "threads": args.threads, "rounds": args.rounds,
            "results": rows_out,
            "totals_ms": {str(r): {p: t * 1e3 for p, t in per.items()}
                          for r, per in totals.items()}}, indent=1))


if __name__ == "__main__":
    main()
