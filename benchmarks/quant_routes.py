"""The quantized kernel's exact and near-exact routes side by side: widening, bf16 pairs,
AMX tiles, int16 pairs.

For each GGUF format, three random matrices of ``--n`` x ``--k`` (about 13-35 MB each,
so they stream from memory as a model's layers do) are multiplied by bf16 activations
of ``--rows`` rows through ``quant_linear``'s widening route, its bf16 route
(``vdpbf16ps``, AVX512-BF16 CPUs only) and its AMX route (``tdpbf16ps``, AMX-BF16 CPUs
only; Q8_0 falls back to widening on both) and its int16 route (``vpmaddwd``, AVX2
CPUs; Q6_K falls back to widening; ``--activations float32`` for float32 models), the
routes taking turns, best of
``--reps``. Prints the time of each, the ratio to widening, and the largest difference
from the widening route's output in bf16 ulps of ``sum_k |x_k w_k|`` (all are float32
sums of exact products, rounded once to bf16, so they differ where a sum rounds the
other way; the int16 route's differences are its rounding of the activations). CPU model
and flags go with the result.

    .venv/bin/python benchmarks/quant_routes.py --json benchmarks/results/quant_routes.json
    .venv/bin/python benchmarks/quant_routes.py --activations float32 --rows 1 4 16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import machine_facts  # noqa: E402
from kernels import quant_linear as ql  # noqa: E402


def random_matrix(n: int, k: int, fmt: int, seed: int) -> ql.PackedWeight:
    """GGUF blocks of random bytes with small finite scales."""
    g = torch.Generator().manual_seed(seed)
    per = ql.SUPERBLOCK if fmt in ql.K_QUANTS else ql.BLOCK
    raw = torch.randint(0, 256, (n, k // per, ql._GGUF_BLOCK_BYTES[fmt]), generator=g,
                        dtype=torch.uint8)
    d = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if fmt == ql.Q6_K:
        raw[..., -2:] = d  # Q6_K's d closes the superblock
    else:
        raw[..., 0:2] = d
    if fmt in (ql.Q4_1, ql.Q4_K):
        raw[..., 2:4] = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8)
    return ql.pack_gguf_blocks(raw.reshape(n, -1), fmt, k)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=11264)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--activations", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.activations)
    routes = [r for r in (ql.WIDEN, ql.BF16DOT, ql.AMX, ql.INT16) if r in ql.routes_available()]
    if len(routes) == 1:
        print("only the widening route is built here (no AVX512-BF16, no AVX2)")
        return 1
    names = {r: n for n, r in ql.ROUTES.items()}
    report = {"machine": machine_facts(), "n": args.n, "k": args.k,
              "activations": args.activations, "results": []}
    for fmt in (ql.Q4_0, ql.Q4_1, ql.Q8_0, ql.Q4_K, ql.Q6_K):
        weights = [random_matrix(args.n, args.k, fmt, seed) for seed in range(3)]
        for rows in args.rows:
            x = torch.randn(rows, args.k).to(dtype)
            best = dict.fromkeys(routes, float("inf"))
            for _ in range(args.reps):
                for route in best:
                    t0 = time.perf_counter()
                    for w in weights:
                        ql.quant_linear(x, w, route=route)
                    best[route] = min(best[route], (time.perf_counter() - t0) / len(weights))
            widened = ql.quant_linear(x, weights[0], route=ql.WIDEN).float()
            # against sum |x| |w| per output, the scale the routes' float32 sums err on
            magnitude = x.float().abs() @ ql.dequantize(weights[0]).abs().t()
            row = {"format": ql.FORMAT_NAMES[fmt], "rows": rows}
            for route in routes:
                out = ql.quant_linear(x, weights[0], route=route).float()
                row[f"{names[route]}_ms"] = best[route] * 1e3
                row[f"{names[route]}_speedup"] = best[ql.WIDEN] / best[route]
                row[f"{names[route]}_max_diff_bf16_ulps"] = (
                    (out - widened).abs() / (magnitude * 2 ** -8)).max().item()
            report["results"].append(row)
            print(f"{row['format']} {rows:2d} rows: " + ", ".join(
                f"{names[r]} {row[f'{names[r]}_ms']:.2f} ms ({row[f'{names[r]}_speedup']:.2f}x, "
                f"{row[f'{names[r]}_max_diff_bf16_ulps']:.2f} ulp)" for r in routes), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
