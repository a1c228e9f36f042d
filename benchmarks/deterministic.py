"""Deterministic mode's cost: the same workloads with worker.deterministic off and on,
side by side in one run, default model, plus whether a seeded request repeats itself.

Workloads (fixed seed, random prompt token ids, ignore_eos, temperature 0.8 seeded):

    batch     N requests of P prompt tokens and O output tokens, one generate() call
    decode1   one request, a 16-token prompt and D output tokens (batch-1 decode)
    prefill   one request of L prompt tokens and 1 output token (one long prefill)

Throughput is tokens / wall time (batch: generated tokens; decode1: generated tokens;
prefill: prompt tokens); the ratio deterministic / default is printed per workload.
Each mode also sends one seeded request twice (the second time its prompt comes from
the prefix cache) and records whether tokens and logprobs repeated bitwise.

    nice -n 19 .venv/bin/python benchmarks/deterministic.py \\
        --json benchmarks/results/deterministic.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lora_throughput import machine  # noqa: E402


def _prompts(rng: random.Random, count: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(length)]}
            for _ in range(count)]


def _timed(llm, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def run_mode(args, deterministic: bool) -> dict:
    from folio import LLM, SamplingParams
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
              **{"worker.deterministic": deterministic,
                 "observability.log_level": "warning"})
    rng = random.Random(0)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=args.output_len,
                            ignore_eos=True, logprobs=1)
    llm.generate(_prompts(rng, 2, 32), SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    result = {"dtype": str(llm.runner.dtype).removeprefix("torch.")}
    batch = _prompts(rng, args.num_prompts, args.prompt_len)
    seconds, outs = _timed(llm, batch, seeded)
    result["batch"] = {"seconds": seconds, "tok_s": args.num_prompts * args.output_len / seconds}
    short = _prompts(rng, 1, 16)
    seconds, _ = _timed(llm, short, SamplingParams(temperature=0.8, seed=1, ignore_eos=True,
                                                   max_tokens=args.decode_len))
    result["decode1"] = {"seconds": seconds, "tok_s": args.decode_len / seconds}
    long = _prompts(rng, 1, args.long_prompt_len)
    seconds, _ = _timed(llm, long, SamplingParams(max_tokens=1))
    result["prefill"] = {"seconds": seconds, "tok_s": args.long_prompt_len / seconds}
    # the first batch prompt again: its prefix is now cached
    _, again = _timed(llm, batch[:1], seeded)

    def key(o):
        c = o.outputs[0]
        return c.token_ids, [lp.logprob for lp in c.token_logprobs]
    first, second = key(outs[0]), key(again[0])
    diff = next((i for i, pair in enumerate(zip(zip(*first), zip(*second)))
                 if pair[0] != pair[1]), None)
    result["repeat_from_prefix_cache"] = {
        "num_cached_tokens": again[0].num_cached_tokens,
        "tokens_identical": first[0] == second[0],
        "tokens_and_logprobs_identical": first == second,
        "first_differing_token": diff}
    llm.shutdown()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=40)
    p.add_argument("--decode-len", type=int, default=32)
    p.add_argument("--long-prompt-len", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    for name, deterministic in (("default", False), ("deterministic", True)):
        results[name] = run_mode(args, deterministic)
    ratios = {w: results["deterministic"][w]["tok_s"] / results["default"][w]["tok_s"]
              for w in ("batch", "decode1", "prefill")}
    results["deterministic_vs_default"] = ratios
    print(f"{'workload':10} {'default tok/s':>14} {'deterministic':>14} {'ratio':>7}")
    for w, r in ratios.items():
        print(f"{w:10} {results['default'][w]['tok_s']:14.1f} "
              f"{results['deterministic'][w]['tok_s']:14.1f} {r:7.2f}")
    for name in ("default", "deterministic"):
        print(f"{name}: seeded request repeated from the prefix cache: "
              f"{results[name]['repeat_from_prefix_cache']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
