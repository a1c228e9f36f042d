"""Speculative decoding on the default model, in one run (offline engine, greedy):

  copy     single stream, copy-heavy chat prompts (300-800 tokens, answers repeat
           spans of them): n-gram vs off, output tok/s, outputs identical (>= 1.8x)
  chat     single stream, free-form chat: n-gram with adaptive k on, and off, vs
           speculation off (adaptive on: at most 5% slower)
  batch    N concurrent free-form chat requests: n-gram (adaptive) vs off (<= 5% slower)
  draft    draft_model with the model as its own draft, copy prompts: acceptance, and
           what a step costs against a step without drafts

Each mode runs in a fresh LLM after a warm-up request; prompts run one after another
(single stream) or all at once (batch). Results (with the CPU model and the machine's
load average) go to --json.

    .venv/bin/python benchmarks/spec_decode.py --json benchmarks/results/spec_decode.json
    .venv/bin/python benchmarks/spec_decode.py --quick      # a smoke run
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from folio.bench.spec_prompts import chat_messages, copy_messages  # noqa: E402

OFF = {"speculative.method": "none"}


def ngram(args, adaptive=True) -> dict:
    return {"speculative.method": "ngram", "speculative.num_speculative_tokens": args.k,
            "speculative.enable_adaptive": adaptive}


def make_llm(args, spec: dict):
    from folio import LLM
    return LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
               num_blocks=args.num_blocks, **spec, **{"observability.log_level": "warning"})


def run_mode(args, spec: dict, conversations, max_tokens: int, concurrent: bool) -> dict:
    """Generate every conversation (one at a time unless ``concurrent``); the outputs,
    output tokens, seconds, engine steps and spec-decode counters."""
    from folio import SamplingParams
    llm = make_llm(args, spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(conversations[0], SamplingParams(temperature=0.0, max_tokens=8),
             use_tqdm=False)  # warm-up
    steps = [0]
    step = llm.engine.step

    def counted_step():
        steps[0] += 1
        return step()
    llm.engine.step = counted_step
    before = llm.engine.get_stats().spec_decode
    t0 = time.perf_counter()
    if concurrent:
        outs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outs = [o for c in conversations for o in llm.chat(c, params, use_tqdm=False)]
    seconds = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    result = {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "steps": steps[0],
              "tokens": tokens, "spec": _spec_delta(before, llm.engine.get_stats().spec_decode)}
    result["tok_s"] = result["output_tokens"] / seconds
    del llm
    gc.collect()
    return result


def _spec_delta(before, after) -> dict | None:
    if after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {"num_drafts": drafts, "num_draft_tokens": proposed,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_per_draft": accepted / drafts if drafts else 0.0}


def compare(name: str, base: dict, runs: dict[str, dict]) -> dict:
    """Print and return each run's tok/s against ``base`` and whether outputs match."""
    out = {"off": _summary(base)}
    print(f"\n{name}: off {base['tok_s']:.1f} tok/s ({base['output_tokens']} tokens, "
          f"{base['steps']} steps)")
    for label, run in runs.items():
        row = _summary(run) | {"ratio": run["tok_s"] / base["tok_s"],
                               "identical": run["tokens"] == base["tokens"]}
        out[label] = row
        spec = run["spec"] or {}
        print(f"  {label:14s} {run['tok_s']:6.1f} tok/s  x{row['ratio']:.2f}  "
              f"identical={row['identical']}  steps={run['steps']}  "
              f"acceptance={spec.get('acceptance_rate', 0):.2f}")
    return out


def _summary(run: dict) -> dict:
    return {k: run[k] for k in ("seconds", "output_tokens", "steps", "tok_s", "spec")}


def draft_section(args, conversations, base: dict) -> dict:
    spec = {"speculative.method": "draft_model", "speculative.draft_model": args.model,
            "speculative.num_speculative_tokens": args.k}
    run = run_mode(args, spec, conversations, args.copy_tokens, concurrent=False)
    result = compare("draft_model (the model as its own draft), copy prompts", base,
                     {"draft_model": run})
    step_cost = (run["seconds"] / run["steps"]) / (base["seconds"] / base["steps"])
    tokens_per_step = run["output_tokens"] / run["steps"]
    result["step_cost_vs_off"] = step_cost
    result["tokens_per_step"] = tokens_per_step
    print(f"  a step with drafts costs {step_cost:.2f}x a step without; "
          f"{tokens_per_step:.2f} tokens per step")
    return result


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "load_average": os.getloadavg()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--copy-tokens", type=int, default=256)
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=640)
    p.add_argument("--sections", nargs="*", default=["copy", "chat", "batch", "draft"])
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 prompts, 16 tokens")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    copies, chats = copy_messages(), chat_messages()
    if args.quick:
        copies, chats = copies[:2], chats[:2]
        args.copy_tokens = args.chat_tokens = 16
        args.concurrency = 4
    # distinct prompts (numbered), so the prefix cache does not serve whole prompts
    batch = [[{"role": "user", "content": f"({i + 1}) {chats[i % len(chats)][0]['content']}"}]
             for i in range(args.concurrency)]
    results: dict = {"machine": machine(), "args": vars(args)}
    print(f"machine: {results['machine']}")
    if {"copy", "draft"} & set(args.sections):
        copy_off = run_mode(args, OFF, copies, args.copy_tokens, concurrent=False)
    if "copy" in args.sections:
        results["copy"] = compare("copy-heavy, single stream", copy_off, {
            "ngram": run_mode(args, ngram(args), copies, args.copy_tokens, False)})
    if "chat" in args.sections:
        chat_off = run_mode(args, OFF, chats, args.chat_tokens, concurrent=False)
        results["chat"] = compare("free-form chat, single stream", chat_off, {
            "ngram adaptive": run_mode(args, ngram(args), chats, args.chat_tokens, False),
            "ngram fixed k": run_mode(args, ngram(args, False), chats, args.chat_tokens,
                                      False)})
    if "batch" in args.sections:
        batch_off = run_mode(args, OFF, batch, args.chat_tokens, concurrent=True)
        results["batch"] = compare(f"{args.concurrency} concurrent chat requests", batch_off,
                                   {"ngram adaptive": run_mode(args, ngram(args), batch,
                                                               args.chat_tokens, True)})
    if "draft" in args.sections:
        results["draft"] = draft_section(args, copies, copy_off)
    results["machine"]["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
