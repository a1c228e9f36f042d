"""A short request's first token while other busy processes share the worker's cores,
with libgomp's default OpenMP spin count against Folio's (``worker.omp_spin_count``).

For each setting a `folio serve` stack (default model and config, but the spin count)
answers ``--requests`` streamed completions of 16 tokens one after another, first alone,
then while ``--busy`` processes spin at the same priority (each ``while True: pass``):
a stand-in for anything else on a small machine (a client, a tokenizer bomb, another
service). Reported per setting: time to first token p50 / p90 / max, unloaded and
loaded, and the loaded / unloaded ratio of the medians. The CPU model and flags are
recorded with the result.

    .venv/bin/python benchmarks/cpu_contention.py --json benchmarks/results/cpu_contention.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_facts  # noqa: E402
from benchmarks.serve_stack import served_model, serving  # noqa: E402


def first_token_seconds(url: str, model: str, i: int) -> float:
    body = json.dumps({"model": model, "prompt": f"Question {i}: what is the capital of "
                       f"France? Answer:", "max_tokens": 16, "stream": True,
                       "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        first = None
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first


def summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"p50_ms": 1e3 * statistics.median(ordered),
            "p90_ms": 1e3 * ordered[max(0, round(0.9 * len(ordered)) - 1)],
            "max_ms": 1e3 * ordered[-1], "all_ms": [1e3 * s for s in seconds]}


def measure(spin_count, args) -> dict:
    settings = {"worker": {"omp_spin_count": spin_count, "num_threads": args.threads},
                "observability": {"log_level": "warning"}}
    with serving(settings) as (url, _):
        model = served_model(url)
        for i in range(3):  # warm-up
            first_token_seconds(url, model, i)
        alone = [first_token_seconds(url, model, i) for i in range(args.requests)]
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
        try:
            time.sleep(1.0)
            loaded = [first_token_seconds(url, model, i) for i in range(args.requests)]
        finally:
            for p in busy:
                p.kill()
                p.wait()
    row = {"omp_spin_count": spin_count, "alone": summary(alone), "loaded": summary(loaded)}
    row["p50_ratio"] = row["loaded"]["p50_ms"] / row["alone"]["p50_ms"]
    name = "libgomp default" if spin_count is None else f"omp_spin_count {spin_count}"
    print(f"{name:>22}: alone p50 {row['alone']['p50_ms']:.0f} ms (max "
          f"{row['alone']['max_ms']:.0f}); with {args.busy} busy p50 "
          f"{row['loaded']['p50_ms']:.0f} ms (p90 {row['loaded']['p90_ms']:.0f}, max "
          f"{row['loaded']['max_ms']:.0f}): {row['p50_ratio']:.1f}x", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the stack")
    ap.add_argument("--threads", type=int, default=0, help="worker.num_threads (0: all)")
    ap.add_argument("--spin-counts", nargs="+", default=["null", "3000"],
                    help="worker.omp_spin_count values; null is libgomp's default")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    facts = machine_facts()
    print(f"{facts['cpu_model']}; {' '.join(facts['cpu_flags'])}", flush=True)
    counts = [None if c == "null" else int(c) for c in args.spin_counts]
    result = {"machine": facts, "requests": args.requests, "busy": args.busy,
              "rows": [measure(c, args) for c in counts], "machine_at_end": machine_facts()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
