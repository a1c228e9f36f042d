"""Decode steps of two checkouts side by side (batch 1, or ``--batch``): a change against
its base.

A kernel change cannot be toggled inside one process (the native extension is built per
source folder), so each checkout runs in a process of its own, base then this one,
alternated ``--pairs`` times in one sitting (a shared VM drifts by more than a small
gain). Each process prefills one request (``--batch`` of them) of ``context`` prompt
tokens and times the steps in which they all decode with ``decode_roofline.time_decode_steps`` (the whole engine step), for
every context in ``--contexts``; the median step is reported per pair, with the ratio
base / this. The CPU model and flags are recorded with the result.

    git worktree add /tmp/base <rev>   # or: git archive <rev> | tar -x -C /tmp/base
    .venv/bin/python benchmarks/decode_checkouts.py --base /tmp/base --contexts 128 250 400 900
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """Runs inside one checkout: prints {context: median step seconds} as JSON."""
    sys.path.insert(0, str(Path.cwd()))
    import torch
    from benchmarks.decode_roofline import time_decode_steps
    from folio import LLM
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, quantization=args.quantization, num_threads=args.threads,
              max_num_seqs=max(8, args.batch), max_num_batched_tokens=2048,
              max_model_len=max(args.contexts) + args.steps + args.warmup_steps + 64,
              enable_prefix_caching=False, kv_cache_bytes=1 << 30,
              **{"observability.log_level": "warning"})
    time_decode_steps(llm, 1, 128, 16, 8)  # first steps of a process run slow
    out = {c: statistics.median(time_decode_steps(llm, args.batch, c, args.steps,
                                                  args.warmup_steps))
           for c in args.contexts}
    print("RESULT " + json.dumps(out))


def run_checkout(root: Path, args) -> dict[int, float]:
    cmd = [sys.executable, str(HERE / "benchmarks" / "decode_checkouts.py"), "--child",
           "--contexts", *map(str, args.contexts), "--model", args.model,
           "--quantization", args.quantization, "--threads", str(args.threads),
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
           "--batch", str(args.batch)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{root}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, help="the other checkout (its own folder)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 250, 400, 900])
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup-steps", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.base is None:
        ap.error("--base is required")
    sys.path.insert(0, str(HERE))
    from benchmarks.machine import machine_facts
    facts = machine_facts()
    print(f"{facts['cpu_model']}; {' '.join(facts['cpu_flags'])}")
    pairs = []
    for p in range(args.pairs):
        base, this = run_checkout(args.base.resolve(), args), run_checkout(HERE, args)
        pairs.append({"base_ms": {c: base[c] * 1e3 for c in args.contexts},
                      "this_ms": {c: this[c] * 1e3 for c in args.contexts}})
        for c in args.contexts:
            print(f"pair {p + 1} context {c:5d}: base {base[c] * 1e3:6.3f} ms, this "
                  f"{this[c] * 1e3:6.3f} ms, base / this {base[c] / this[c]:.2f}x")
    for c in args.contexts:
        ratios = [q["base_ms"][c] / q["this_ms"][c] for q in pairs]
        print(f"context {c:5d}: base / this median {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        args.json.write_text(json.dumps({"machine": facts, "machine_after": machine_facts(),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "pairs": pairs}, indent=1))


if __name__ == "__main__":
    main()
