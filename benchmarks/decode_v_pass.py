"""The decode kernel's two V passes (``worker.decode_v_pass``) side by side: speed as
``auto`` times them at start-up, and what the paired pass does to greedy answers.

One offline engine of the default model in bf16 (bf16 KV cache) generates the same
prompts greedily under ``widened``, ``widened`` again (the engine's own run-to-run
spread) and ``paired``, the pass switched on the worker's attention backend between
runs, and counts the prompts whose tokens differ from the first run. Then
``worker/decode_v_pass.measure`` times both passes on the model's head shape
``--timings`` times. The CPU model and flags are recorded with the result.

    .venv/bin/python benchmarks/decode_v_pass.py --json benchmarks/results/decode_v_pass_avx512_epyc.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_facts  # noqa: E402

PROMPTS = ([f"Question {i}: explain why the sky is blue in {i + 2} sentences." for i in range(12)]
           + ["What is the capital of France?", "Write a haiku about autumn.",
              "List three prime numbers.", "Translate 'good morning' to Spanish.",
              "Summarize the plot of Hamlet."]
           + ["Once upon a time " * (k + 1) for k in range(0, 120, 20)])


def first_differences(base: list[list[int]], other: list[list[int]]) -> list[int | None]:
    """Per prompt, the index of the first token that differs (None: all the same)."""
    return [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            for a, b in zip(base, other)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timings", type=int, default=5, help="runs of the start-up timing")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from engine_core.sampling_params import SamplingParams
    from folio import LLM
    from kernels import cpu_paged_attention
    from worker.decode_v_pass import measure
    facts = machine_facts()
    print(f"{facts['cpu_model']}; {' '.join(facts['cpu_flags'])}")
    if "paired" not in cpu_paged_attention.decode_v_passes():
        raise SystemExit("the paired V pass is not built here (it needs AVX512-BF16)")
    llm = LLM(model="default", dtype="bfloat16", max_model_len=1024,
              **{"observability.log_level": "warning"})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {}
    for label, v_pass in (("widened", "widened"), ("widened again", "widened"),
                          ("paired", "paired")):
        llm.runner.attention_backend = replace(llm.runner.attention_backend,
                                               decode_v_pass=v_pass)
        runs[label] = [o.outputs[0].token_ids
                       for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    result = {"machine": facts, "prompts": len(PROMPTS), "max_tokens": args.max_tokens,
              "greedy": {}}
    for label in ("widened again", "paired"):
        firsts = first_differences(runs["widened"], runs[label])
        changed = sum(f is not None for f in firsts)
        result["greedy"][label] = {"changed_prompts": changed, "first_differences": firsts}
        print(f"{label} vs widened: {changed} of {len(PROMPTS)} prompts' {args.max_tokens} "
              f"greedy tokens changed; first differences {firsts}")
    arch, shard = llm.runner.arch, llm.runner.model.shard
    timings = [measure(shard.num_heads, shard.num_kv_heads, arch.head_dim)
               for _ in range(args.timings)]
    ratios = [t["widened"] / t["paired"] for t in timings]
    result["timings_s"] = timings
    result["widened_over_paired"] = ratios
    print("start-up timing, widened / paired: "
          + ", ".join(f"{r:.2f}x" for r in ratios))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
