"""Multi-step decoding under load: `folio serve` with scheduler.num_scheduler_steps at
each value given, the same Poisson workload through each, alternated A B A B, and the
ratios of output throughput, TTFT and TPOT against the first value.

A run of decode steps saves the engine core's and the API's per-token work, and makes
a request arriving meanwhile wait for the run in flight; this shows both at the load
chosen (``--request-rate``, ``--max-concurrency``).

    .venv/bin/python benchmarks/decode_steps.py --steps 1 4 --request-rate 4 \
        --json benchmarks/results/decode_steps.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import machine_facts  # noqa: E402
from benchmarks.serve_stack import served_model, serving  # noqa: E402


def run_once(settings: dict, num_steps: int, reqs, spec) -> dict:
    from folio.bench.serve import bench_serve
    tree = {**settings, "scheduler": {"num_scheduler_steps": num_steps}}
    with serving(tree) as (url, _):
        model = served_model(url)
        bench_serve(url, model, reqs[:2], spec)  # warm-up
        report = bench_serve(url, model, reqs, spec)
    return {"num_scheduler_steps": num_steps, "failed": report["failed"],
            "output_tok_s": report["output_throughput"],
            "ttft_ms_p50": report["ttft_ms"]["p50"], "ttft_ms_p99": report["ttft_ms"]["p99"],
            "tpot_ms_mean": report["tpot_ms"]["mean"], "e2e_ms_p99": report["e2e_ms"]["p99"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2, help="A B A B ...: rounds of all values")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from folio.bench.serve import LoadSpec
    from folio.bench.workload import make_workload
    from text.tokenizer import Tokenizer
    reqs = make_workload(Tokenizer.from_model_path(args.model), "uniform", args.num_prompts,
                         args.input_len, args.output_len, seed=1)
    spec = LoadSpec(request_rate=args.request_rate, max_concurrency=args.max_concurrency)
    settings = {"model": {"path": args.model, "quantization": args.quantization},
                "observability": {"log_level": "warning"}}
    result = {"machine_at_start": machine_facts(), "args": vars(args), "runs": []}
    for round_ in range(args.rounds):
        for num_steps in args.steps:
            run = run_once(settings, num_steps, reqs, spec)
            run["round"] = round_
            result["runs"].append(run)
            print(f"round {round_} steps {num_steps}: {run['output_tok_s']:.1f} tok/s, "
                  f"TTFT p50 {run['ttft_ms_p50']:.0f} / p99 {run['ttft_ms_p99']:.0f} ms, "
                  f"TPOT {run['tpot_ms_mean']:.2f} ms, failed {run['failed']}", flush=True)
    base = args.steps[0]
    summary = {}
    for num_steps in args.steps:
        runs = [r for r in result["runs"] if r["num_scheduler_steps"] == num_steps]
        summary[num_steps] = {k: statistics.median(r[k] for r in runs)
                              for k in ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99",
                                        "tpot_ms_mean", "e2e_ms_p99")}
    for num_steps in args.steps[1:]:
        s, b = summary[num_steps], summary[base]
        print(f"steps {num_steps} vs {base} (medians): output tok/s "
              f"{s['output_tok_s'] / b['output_tok_s']:.2f}x, TTFT p50 "
              f"{s['ttft_ms_p50'] / b['ttft_ms_p50']:.2f}x, p99 "
              f"{s['ttft_ms_p99'] / b['ttft_ms_p99']:.2f}x, TPOT "
              f"{s['tpot_ms_mean'] / b['tpot_ms_mean']:.2f}x")
    result["medians"] = summary
    result["machine_at_end"] = machine_facts()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
