"""Deterministic mode's cost: the same workloads with worker.deterministic off and on,
side by side in one run, default model, plus whether a seeded request repeats itself.

Workloads (fixed seed, random prompt token ids, ignore_eos, temperature 0.8 seeded):

    batch     N requests of P prompt tokens and O output tokens, one generate() call
    decode1   one request, a 16-token prompt and D output tokens (batch-1 decode)
    prefill   one request of L prompt tokens and 1 output token (one long prefill)

Both engines are built first and the runs alternate between them (``--repeats`` each),
so the load of a shared machine weighs on both modes alike. Throughput is tokens over
the median wall time (batch, decode1: generated tokens; prefill: prompt tokens); the
ratio deterministic / default is printed per workload. Each mode then sends one seeded
request (temperature 0.8, 40 tokens) twice, the second time from the prefix cache,
and records whether tokens and logprobs repeated bitwise.

    nice -n 19 .venv/bin/python benchmarks/deterministic.py \\
        --json benchmarks/results/deterministic.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
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


def _outcome(output) -> tuple[list[int], list[float]]:
    c = output.outputs[0]
    return c.token_ids, [lp.logprob for lp in c.token_logprobs]


def repeat_from_prefix_cache(llm, prompt, params) -> dict:
    """Send one seeded request twice; the second time its prompt is a prefix-cache hit."""
    first = _outcome(llm.generate(prompt, params, use_tqdm=False)[0])
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    second = _outcome(again)
    diff = next((i for i, pair in enumerate(zip(zip(*first), zip(*second)))
                 if pair[0] != pair[1]), None)
    return {"num_cached_tokens": again.num_cached_tokens,
            "tokens_identical": first[0] == second[0],
            "tokens_and_logprobs_identical": first == second,
            "first_differing_token": diff}


def workloads(args) -> dict[str, tuple[list[dict], object, int]]:
    """name → (prompts, params, tokens that count for tok/s)."""
    from folio import SamplingParams
    rng = random.Random(0)
    sampled = dict(temperature=0.8, ignore_eos=True)
    return {
        "batch": (_prompts(rng, args.num_prompts, args.prompt_len),
                  SamplingParams(seed=7, max_tokens=args.output_len, **sampled),
                  args.num_prompts * args.output_len),
        "decode1": (_prompts(rng, 1, 16), SamplingParams(seed=1, max_tokens=args.decode_len,
                                                          **sampled), args.decode_len),
        "prefill": (_prompts(rng, 1, args.long_prompt_len), SamplingParams(max_tokens=1),
                    args.long_prompt_len),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--decode-len", type=int, default=24)
    p.add_argument("--long-prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode and workload "
                   "(alternating modes); tok/s from the median")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from folio import LLM, SamplingParams
    results = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    modes = ("default", "deterministic")
    # Both engines live side by side and the runs alternate, so a shared machine's load
    # drifts over both modes alike; prefix caching is off for the timed workloads.
    llms = {m: LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
                   enable_prefix_caching=False,
                   **{"worker.deterministic": m == "deterministic",
                      "observability.log_level": "warning"}) for m in modes}
    for m in modes:
        results[m] = {"dtype": str(llms[m].runner.dtype).removeprefix("torch.")}
        llms[m].generate(_prompts(random.Random(1), 2, 32), SamplingParams(max_tokens=4),
                         use_tqdm=False)  # warm up
    for w, (prompts, params, num_tokens) in workloads(args).items():
        seconds = {m: [] for m in modes}
        for _ in range(args.repeats):
            for m in modes:
                seconds[m].append(_timed(llms[m], prompts, params)[0])
        for m in modes:
            best = statistics.median(seconds[m])
            results[m][w] = {"seconds": seconds[m], "median_s": best,
                             "tok_s": num_tokens / best}
    prompt = _prompts(random.Random(2), 1, args.prompt_len)[0]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True,
                            logprobs=1)
    for m in modes:
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
                  **{"worker.deterministic": m == "deterministic",
                     "observability.log_level": "warning"})
        results[m]["repeat_from_prefix_cache"] = repeat_from_prefix_cache(llm, prompt, seeded)
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
