"""What the process split costs: one offline workload through the in-process engine
(``LLM.generate``) and through the three services (`folio serve`: API, engine core and
worker processes over unix sockets), in one run, with the same settings.

Workload (fixed seed): N requests of random prompt token ids and output lengths,
ignore_eos, greedy, all submitted at once. Over HTTP the prompts go as token ids to
/v1/completions, so tokenization is not part of either measurement; detokenization is
(the API process detokenizes every delta, the offline engine its outputs).

    .venv/bin/python benchmarks/ipc_overhead.py --json benchmarks/results/ipc_overhead.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.offline_throughput import make_workload  # noqa: E402
from benchmarks.serve_stack import run_served  # noqa: E402


def engine_settings(args) -> dict:
    return {"model": {"path": args.model, "dtype": args.dtype, "max_model_len": 1024},
            "memory": {"kv_cache_bytes": int(args.kv_cache_gib * 1024 ** 3)},
            "scheduler": {"max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens},
            "cache": {"enable_prefix_caching": False},
            "observability": {"log_level": "warning"}}


def run_in_process(reqs, args) -> dict:
    from folio import LLM, SamplingParams
    from config.loader import load_config
    llm = LLM(load_config(overrides={f"{section}.{key}": value
                                     for section, values in engine_settings(args).items()
                                     for key, value in values.items()}, use_env=False))
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": num_out}


def run_services(reqs, args) -> dict:
    settings = engine_settings(args)
    settings["services"] = {"num_api_servers": args.num_api_servers}
    return run_served(settings, reqs, args.stream)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--num-api-servers", type=int, default=1)
    p.add_argument("--stream", action="store_true", help="stream every response over SSE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each mode, alternating which goes first; the best counts")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    reqs = make_workload(args.num_requests, args.seed, args.prompt_len, args.output_len,
                         vocab_size=49152)
    expected = sum(n for _, n in reqs)
    results = {"in_process": [], "services": []}
    runs = [("in_process", run_in_process), ("services", run_services)]
    for repeat in range(args.repeats):
        for name, run in (runs if repeat % 2 == 0 else runs[::-1]):  # alternate the order
            r = run(reqs, args)
            assert r["output_tokens"] == expected, f"{name}: {r['output_tokens']} != {expected}"
            r.setdefault("output_tokens_per_s", r["output_tokens"] / r["seconds"])
            results[name].append(r)
            print(f"{name:>10}: {r['output_tokens']} tokens in {r['seconds']:.1f}s = "
                  f"{r['output_tokens_per_s']:.1f} output tok/s", flush=True)
    best = {name: max(r["output_tokens_per_s"] for r in rs) for name, rs in results.items()}
    ratio = best["services"] / best["in_process"]
    print(f"best of {args.repeats}: in-process {best['in_process']:.1f}, services "
          f"{best['services']:.1f} output tok/s")
    print(f"services / in-process throughput: {ratio:.3f} (target >= 0.95)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "workload": {k: v for k, v in vars(args).items() if k != "json"},
            "results": results, "best_output_tokens_per_s": best, "ratio": ratio},
            indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
