"""Deterministic mode's cost: the same workloads with worker.deterministic off and on,
side by side in one run, default model, plus whether a seeded request repeats itself.

Workloads (fixed seed, random prompt token ids, ignore_eos, temperature 0.8 seeded):

    batch     N requests of P prompt tokens and O output tokens, one generate() call
    decode1   one request, a 16-token prompt and D output tokens (batch-1 decode)
    prefill   one request of L prompt tokens and 1 output token (one long prefill)

Both engines are built first and the runs alternate between them (``--repeats`` each),
so the load of a shared machine weighs on both modes alike. Throughput is tokens over
the best wall time (batch, decode1: generated tokens; prefill: prompt tokens), and,
steadier beside other jobs, tokens per CPU second of the process (median); the ratios
deterministic / default are printed per workload. Each mode then sends one seeded
request (temperature 0.8, 40 tokens) twice, the second time from the prefix cache,
and records whether tokens and logprobs repeated bitwise.

    nice -n 19 .venv/bin/python benchmarks/deterministic.py \\
        --json benchmarks/results/deterministic.json
    nice -n 19 .venv/bin/python benchmarks/deterministic.py --attention \\
        --json benchmarks/results/deterministic_attention.json
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


def _timed(llm, prompts, params) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, every thread)."""
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0


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


def attention_rows(lengths=(512, 2048), repeats=5) -> dict:
    """One layer's prefill attention over a fresh prompt (SmolLM2's heads, bf16): the
    default path (SDPA, causal) against deterministic mode's one decode row per token
    (the native kernel); best of ``repeats``, milliseconds."""
    import torch
    from kernels.paged_attention import make_plan, paged_attention
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    out = {}
    for n in lengths:
        num_blocks = n // block + 1
        cache = torch.randn(2, num_blocks, block, kv_heads, head_dim, generator=gen).bfloat16()
        q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
        k, v = (cache[i].reshape(-1, kv_heads, head_dim)[:n] for i in (0, 1))
        table = torch.arange(num_blocks)[None]
        plans = {"default_sdpa": make_plan([0, n], [n], table, block, None, True),
                 "deterministic_rows": make_plan(list(range(n + 1)), list(range(1, n + 1)),
                                                 table.expand(n, num_blocks), block, None,
                                                 True)}
        for name, plan in plans.items():
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                t0 = time.perf_counter()
                paged_attention(q, k, v, cache, plan, head_dim ** -0.5)
                times.append(time.perf_counter() - t0)
            out[f"{name}_{n}_ms"] = min(times[1:]) * 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--decode-len", type=int, default=16)
    p.add_argument("--long-prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode and workload "
                   "(alternating modes); tok/s from the best wall time")
    p.add_argument("--attention", action="store_true", help="only the attention kernels: "
                   "SDPA vs one decode row per token, one layer (attention_rows)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.attention:
        results = {"machine": machine(), "attention_per_layer": attention_rows()}
        print(json.dumps(results["attention_per_layer"], indent=2))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        return 0
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
        runs = {m: [] for m in modes}
        for _ in range(args.repeats):
            for m in modes:
                runs[m].append(_timed(llms[m], prompts, params))
        for m in modes:
            wall = min(r[0] for r in runs[m])
            cpu = statistics.median(r[1] for r in runs[m])
            results[m][w] = {"wall_s": [r[0] for r in runs[m]],
                             "cpu_s": [r[1] for r in runs[m]],
                             "tok_s": num_tokens / wall, "tok_per_cpu_s": num_tokens / cpu}
    prompt = _prompts(random.Random(2), 1, args.prompt_len)[0]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True,
                            logprobs=1)
    for m in modes:
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
                  **{"worker.deterministic": m == "deterministic",
                     "observability.log_level": "warning"})
        results[m]["repeat_from_prefix_cache"] = repeat_from_prefix_cache(llm, prompt, seeded)
    work = ("batch", "decode1", "prefill")
    results["deterministic_vs_default"] = {
        w: {"tok_s": results["deterministic"][w]["tok_s"] / results["default"][w]["tok_s"],
            "tok_per_cpu_s": results["deterministic"][w]["tok_per_cpu_s"]
            / results["default"][w]["tok_per_cpu_s"]} for w in work}
    print(f"{'workload':9} {'default tok/s':>13} {'determ. tok/s':>13} {'ratio':>6}   "
          f"{'default tok/cpu-s':>17} {'determ.':>8} {'ratio':>6}")
    for w in work:
        d, t = results["default"][w], results["deterministic"][w]
        r = results["deterministic_vs_default"][w]
        print(f"{w:9} {d['tok_s']:13.1f} {t['tok_s']:13.1f} {r['tok_s']:6.2f}   "
              f"{d['tok_per_cpu_s']:17.1f} {t['tok_per_cpu_s']:8.1f} {r['tok_per_cpu_s']:6.2f}")
    for name in ("default", "deterministic"):
        print(f"{name}: seeded request repeated from the prefix cache: "
              f"{results[name]['repeat_from_prefix_cache']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
