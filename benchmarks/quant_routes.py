"""The quantized kernel's exact routes side by side: widening and bf16 pairs.

For each GGUF format, three random matrices of ``--n`` x ``--k`` (about 13-35 MB each,
so they stream from memory as a model's layers do) are multiplied by bf16 activations
of 1 and 32 rows through ``quant_linear``'s widening route and its bf16 route
(``vdpbf16ps``, AVX512-BF16 CPUs only; Q8_0 falls back to widening there), the routes
taking turns, best of ``--reps``. Prints the time of each, the ratio, and the largest
difference between the two outputs in bf16 ulps of ``sum_k |x_k w_k|`` (both are float32
sums of exact products, rounded once to bf16, so they differ where a sum rounds the
other way). CPU model and flags go with the result.

    .venv/bin/python benchmarks/quant_routes.py --json benchmarks/results/quant_routes.json
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
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if ql.BF16DOT not in ql.routes_available():
        print("the bf16 route is not built here (no AVX512-BF16)")
        return 1
    report = {"machine": machine_facts(), "n": args.n, "k": args.k, "results": []}
    for fmt in (ql.Q4_0, ql.Q4_1, ql.Q8_0, ql.Q4_K, ql.Q6_K):
        weights = [random_matrix(args.n, args.k, fmt, seed) for seed in range(3)]
        for rows in (1, 32):
            x = torch.randn(rows, args.k).to(torch.bfloat16)
            best = {ql.WIDEN: float("inf"), ql.BF16DOT: float("inf")}
            for _ in range(args.reps):
                for route in best:
                    t0 = time.perf_counter()
                    for w in weights:
                        ql.quant_linear(x, w, route=route)
                    best[route] = min(best[route], (time.perf_counter() - t0) / len(weights))
            a = ql.quant_linear(x, weights[0], route=ql.WIDEN).float()
            b = ql.quant_linear(x, weights[0], route=ql.BF16DOT).float()
            # against sum |x| |w| per output, the scale both routes' float32 sums err on
            magnitude = x.float().abs() @ ql.dequantize(weights[0]).abs().t()
            ulps = ((a - b).abs() / (magnitude * 2 ** -8)).max().item()
            row = {"format": ql.FORMAT_NAMES[fmt], "rows": rows,
                   "widen_ms": best[ql.WIDEN] * 1e3, "bf16dot_ms": best[ql.BF16DOT] * 1e3,
                   "speedup": best[ql.WIDEN] / best[ql.BF16DOT], "max_diff_bf16_ulps": ulps}
            report["results"].append(row)
            print(f"{row['format']} {rows:2d} rows: widen {row['widen_ms']:.2f} ms, bf16dot "
                  f"{row['bf16dot_ms']:.2f} ms ({row['speedup']:.2f}x), outputs within "
                  f"{ulps:.2f} bf16 ulp of sum |x w|", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
