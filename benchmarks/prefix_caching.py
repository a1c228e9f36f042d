"""Prefix caching on a shared system prompt: time to first token with the cache on and
off, in one run, through `folio serve` and `folio bench serve`'s client.

Workload: N requests that share one --prefix-len token system prompt, each with its own
--input-len tokens after it and --output-len tokens out, sent one after another
(concurrency 1) so that TTFT is each request's own prefill: with the cache on, every
request after the first computes only its own suffix.

    .venv/bin/python benchmarks/prefix_caching.py --json benchmarks/results/prefix_caching.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_stack import serving  # noqa: E402
from folio.bench.serve import LoadSpec, bench_serve, format_report  # noqa: E402
from folio.bench.workload import make_workload  # noqa: E402
from text.tokenizer import Tokenizer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    requests = make_workload(Tokenizer.from_model_path("default"), "shared-prefix",
                             args.num_prompts, args.input_len, args.output_len,
                             prefix_len=args.prefix_len, seed=0)
    reports = {}
    for name, caching in (("prefix_caching_off", False), ("prefix_caching_on", True)):
        settings = {"model": {"dtype": args.dtype, "max_model_len": 2048},
                    "memory": {"kv_cache_bytes": 512 * 1024 ** 2},
                    "cache": {"enable_prefix_caching": caching},
                    "observability": {"log_level": "warning"}}
        with serving(settings) as (url, _):
            bench_serve(url, "SmolLM2-135M-Instruct", requests[:1], LoadSpec())  # warm-up
            # the warm-up used request 0's prompt: measure the others
            report = bench_serve(url, "SmolLM2-135M-Instruct", requests[1:],
                                 LoadSpec(max_concurrency=1))
        reports[name] = report
        print(f"--- {name}\n{format_report(report)}", flush=True)
    off, on = (reports[k]["ttft_ms"] for k in ("prefix_caching_off", "prefix_caching_on"))
    ratios = {q: off[q] / on[q] for q in ("mean", "p50", "p99")}
    print(f"TTFT without / with prefix caching: mean {ratios['mean']:.1f}x, "
          f"p50 {ratios['p50']:.1f}x, p99 {ratios['p99']:.1f}x (target >= 5x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": vars(args), "reports": reports,
                                               "ttft_ratio_off_over_on": ratios},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
