"""How this machine's read bandwidth moves, and whether the quantized tiles follow it.

Two measurements, in one process, CPU model and flags recorded:

* ``buffers``: eight 256 MB float32 buffers summed (torch, all threads) as each is
  allocated, then all eight again: on a host whose bandwidth flips between levels over
  seconds the two passes disagree buffer by buffer.
* ``rounds``: a one-row Q4_1 ``quant_linear`` over ~130 MB of packed weights (18 matrices
  of 5632 x 2048, layers in turn as a decode step reads them) alternated with a torch sum
  over the same number of bytes, best of three passes each per round; the ratio says how
  much of a plain read's rate the tiles' stream reaches at that moment.

    .venv/bin/python benchmarks/memory_stream.py --rounds 30 --json out.json
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


def best_sum_gb_s(buf: torch.Tensor, passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / best / 1e9


def buffer_passes(count: int = 8, mib: int = 256) -> dict:
    """GB/s of each buffer summed as it is allocated, then of all of them again."""
    kept, first = [], []
    for _ in range(count):
        buf = torch.empty(mib * 2 ** 20 // 4, dtype=torch.float32)
        buf.fill_(1.0)
        kept.append(buf)
        first.append(round(best_sum_gb_s(buf, 4), 1))
    return {"as_allocated_gb_s": first,
            "again_gb_s": [round(best_sum_gb_s(b, 3), 1) for b in kept]}


def packed_matrices(n: int, k: int, count: int) -> list:
    from kernels import quant_linear as ql
    mats = []
    for _ in range(count):
        raw = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8)
        # every block's d and m small finite fp16 values (0x2c00, 0xa800)
        raw.view(-1, 20)[:, 0:4] = torch.tensor([0x00, 0x2c, 0x00, 0xa8], dtype=torch.uint8)
        mats.append(ql.pack_gguf_blocks(raw, ql.Q4_1, k))
    return mats


def tile_rounds(rounds: int, n: int = 5632, k: int = 2048, count: int = 18) -> list[dict]:
    """Per round: best of three passes of the tiles and of a sum over as many bytes."""
    from kernels import quant_linear as ql
    mats = packed_matrices(n, k, count)
    nbytes = sum(m.qs.numel() + m.scales.numel() * m.scales.element_size() for m in mats)
    buf = torch.ones(nbytes // 4)
    x = torch.randn(1, k, dtype=torch.bfloat16)

    def tiles() -> float:
        t0 = time.perf_counter()
        for m in mats:
            ql.quant_linear(x, m, None, ql.BEST_INT8)
        return nbytes / (time.perf_counter() - t0) / 1e9

    for _ in range(3):  # warm-up: first touches, the kernels' scratch
        tiles()
        best_sum_gb_s(buf, 1)
    out = []
    for _ in range(rounds):
        s = best_sum_gb_s(buf, 3)
        t = max(tiles() for _ in range(3))
        out.append({"sum_gb_s": round(s, 1), "tiles_gb_s": round(t, 1),
                    "ratio": round(t / s, 2)})
        print(f"sum {s:5.1f} GB/s  tiles {t:5.1f} GB/s  ratio {t / s:.2f}", flush=True)
        time.sleep(0.5)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"machine": machine_facts(), "threads": args.threads}
    result["buffers"] = buffer_passes()
    print("as allocated:", result["buffers"]["as_allocated_gb_s"], flush=True)
    print("again:       ", result["buffers"]["again_gb_s"], flush=True)
    rows = tile_rounds(args.rounds)
    ratios = sorted(r["ratio"] for r in rows)
    result["rounds"] = rows
    result["ratio_min_median_max"] = [ratios[0], ratios[len(ratios) // 2], ratios[-1]]
    print(f"tiles / sum: min {ratios[0]:.2f}, median {ratios[len(ratios) // 2]:.2f}, "
          f"max {ratios[-1]:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
