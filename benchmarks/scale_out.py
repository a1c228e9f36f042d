"""Scale-out figures: data-parallel routing policies side by side, and tensor
parallelism's step times.

Data parallelism (benchmarks/dp_routing.py): `folio serve` with data_parallel_size 2
under each routing policy in turn, a shared-prefix workload (8 prefixes of 1,000
tokens, 64 requests); prompt tokens computed (from /metrics), time, throughput, and
whether every policy gave the same greedy texts.

Tensor parallelism: the same greedy workload at tensor_parallel_size 1
and 2 (gloo on the CPU, or NCCL where each rank has a GPU), timed per engine step.

Workload (fixed seed): 8 requests, random prompts of 64-192 tokens, 32 tokens each,
ignore_eos. Reported per size: median prefill-bearing step and median decode-only step
(wall clock around ModelRunner.execute_model on rank 0, collectives included), and whether the
tokens equal size 1's. On a 2-core CPU two ranks are slower than one: every layer adds
two all-reduces and the ranks share the cores; TP is for models that do not fit one
device.

    .venv/bin/python benchmarks/scale_out.py --model default --dtype float32
    .venv/bin/python benchmarks/scale_out.py --parts dp --policies prefix_aware,round_robin
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def workload(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 192))] for _ in range(n)]


def run(size: int, args) -> dict:
    from folio import LLM, SamplingParams
    with LLM(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, tensor_parallel_size=size,
             num_threads=args.threads, max_model_len=1024,
             **{"observability.log_level": "warning"}) as llm:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [100] * 16}], params, use_tqdm=False)  # warm-up
        prefill, decode, execute = [], [], llm.runner.execute_model

        def timed_execute(so):
            t0 = time.perf_counter()
            output = execute(so)
            seconds = time.perf_counter() - t0
            total, k = so.total_num_scheduled_tokens, so.num_decode_steps
            if total and total == k * len(so.num_scheduled_tokens):
                decode.extend([seconds / k] * k)  # a run of k decode steps: k steps
            elif total:
                prefill.append(seconds)
            return output
        llm.runner.execute_model = timed_execute  # the engine core calls it per step
        outs = llm.generate([{"prompt_token_ids": p} for p in workload(args.seed)], params,
                            use_tqdm=False)
    return {"tensor_parallel_size": size,
            "median_prefill_step_ms": round(1e3 * statistics.median(prefill), 2),
            "median_decode_step_ms": round(1e3 * statistics.median(decode), 2),
            "num_steps": len(prefill) + len(decode),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokenizer", default=None, help="for a checkpoint without one "
                        "(e.g. 'default')")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--json", default=None)
    parser.add_argument("--parts", default="dp,tp", help="dp (routing policies), tp "
                        "(step times), or both")
    parser.add_argument("--policies", default="prefix_aware,round_robin,least_loaded")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="DP: requests in flight at most after the first 8")
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in cpu.splitlines()
                  if line.startswith("Flags")), [])
    report = {"cpu": model, "num_cpus": os.cpu_count(),
              "cpu_flags": [f for f in flags if f.startswith(("avx", "amx"))],
              "model": args.model, "dtype": args.dtype, "threads": args.threads}
    print(f"cpu: {model} ({os.cpu_count()} cpus; {' '.join(report['cpu_flags'])}); "
          f"model {args.model} {args.dtype}; {args.threads} thread(s) per process")
    if "dp" in args.parts.split(","):
        from benchmarks.dp_routing import run_all
        report["data_parallel"] = dp = run_all(args)
        for r in dp:
            print(f"DP=2 {r['routing']:>12}: prompt tokens computed "
                  f"{r['prompt_tokens_computed']} of {r['prompt_tokens']} "
                  f"(per replica {r['prompt_tokens_computed_per_replica']}; round_robin/this "
                  f"{r.get('round_robin_computed_over_this')}), {r['seconds']} s, "
                  f"{r['requests_per_s']} req/s, {r['output_tokens_per_s']} tok/s, same "
                  f"texts: {r['same_texts_as_' + dp[0]['routing']]}")
    if "tp" in args.parts.split(","):
        report["tensor_parallel"] = _tp(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def _tp(args) -> list[dict]:
    results = [run(int(s), args) for s in args.sizes.split(",")]
    base = results[0]["tokens"]
    for r in results:
        r["same_tokens_as_size_1"] = r.pop("tokens") == base
    for r in results:
        print(f"TP={r['tensor_parallel_size']}: prefill step {r['median_prefill_step_ms']} ms, "
              f"decode step {r['median_decode_step_ms']} ms (8 requests), "
              f"{r['num_steps']} steps, same tokens as TP=1: {r['same_tokens_as_size_1']}")
    return results


if __name__ == "__main__":
    main()
