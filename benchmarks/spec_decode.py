"""Speculative decoding on the default model, in one run (offline engine, greedy):

  copy     single stream, copy-heavy chat prompts (300-800 tokens, answers repeat
           spans of them): n-gram vs off, output tok/s, outputs identical (>= 1.8x)
  chat     single stream, free-form chat: n-gram with adaptive k on, and with it off,
           vs speculation off (adaptive on: at most 5% slower)
  batch    N concurrent free-form chat requests: n-gram (adaptive) vs off (<= 5% slower)
  draft    draft_model with the model as its own draft, copy prompts: acceptance, and
           what a step costs against a step without drafts
  structured  single stream, chat requests held to JSON schemas (--sections
           structured): n-gram adaptive and fixed k vs off, outputs identical

The modes of a section are loaded side by side and take turns prompt by prompt (the
order rotating), so a noisy neighbour on a shared machine slows every mode alike;
each mode is warmed up first. Results, with the CPU model and the load average before
and after, go to --json.

    .venv/bin/python benchmarks/spec_decode.py --json benchmarks/results/spec_decode.json
    .venv/bin/python benchmarks/spec_decode.py --quick      # a smoke run
    .venv/bin/python benchmarks/spec_decode.py --num-prompts 2 --copy-tokens 128 \
        --chat-tokens 48 --concurrency 8 --note "..."          # a few minutes
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


class Mode:
    """One engine configuration, timed over the prompts it is given."""

    def __init__(self, args, label: str, spec: dict):
        from folio import LLM, SamplingParams
        self.label = label
        self.llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
                       num_blocks=args.num_blocks, **spec,
                       **{"observability.log_level": "warning"})
        self.llm.chat(chat_messages()[0], SamplingParams(temperature=0.0, max_tokens=8),
                      use_tqdm=False)  # warm-up
        self.seconds, self.steps, self.tokens = 0.0, 0, []
        step = self.llm.engine.step

        def counted_step():
            self.steps += 1
            return step()
        self.llm.engine.step = counted_step
        self.spec_before = self.llm.engine.get_stats().spec_decode

    def run(self, conversations, max_tokens: int) -> None:
        """Generate ``conversations`` (all at once when there are several); a
        ``Constrained`` batch carries each conversation's JSON schema."""
        from folio import SamplingParams
        schemas = getattr(conversations, "schemas", [None] * len(conversations))
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 structured_outputs=None if s is None else {"json": s})
                  for s in schemas]
        t0 = time.perf_counter()
        outs = self.llm.chat(list(conversations), params, use_tqdm=False)
        self.seconds += time.perf_counter() - t0
        self.tokens += [o.outputs[0].token_ids for o in outs]

    def result(self) -> dict:
        num_out = sum(map(len, self.tokens))
        return {"seconds": self.seconds, "output_tokens": num_out, "steps": self.steps,
                "tok_s": num_out / self.seconds, "spec": _spec_delta(
                    self.spec_before, self.llm.engine.get_stats().spec_decode)}


class Constrained(list):
    """Conversations whose outputs are held to ``schemas`` (one each)."""

    def __init__(self, conversations, schemas):
        super().__init__(conversations)
        self.schemas = schemas


def constrained_batches(num_prompts: int) -> list[Constrained]:
    """Single-stream JSON requests: schemas of tests/data/structured_output_schemas.json
    whose outputs run long (arrays of objects: their keys repeat, as n-gram likes)."""
    entries = {e["name"]: e for e in json.loads(
        (REPO / "tests" / "data" / "structured_output_schemas.json").read_text())}
    names = ["team", "playlist", "order", "recipe", "student_grades", "quiz"][:num_prompts]
    return [Constrained([[{"role": "user", "content": entries[n]["prompt"]
                           + " Reply with JSON only."}]], [entries[n]["schema"]])
            for n in names]


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


def section(args, title: str, specs: dict[str, dict], batches: list, max_tokens: int) -> dict:
    """Run every batch of conversations through every mode, taking turns; each mode's
    figures against the first's (``off``), and whether its outputs are the same."""
    modes = [Mode(args, label, spec) for label, spec in specs.items()]
    for i, batch in enumerate(batches):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            mode.run(batch, max_tokens)
    base, out = modes[0].result(), {}
    print(f"\n{title}: off {base['tok_s']:.1f} tok/s ({base['output_tokens']} tokens, "
          f"{base['steps']} steps, {base['seconds']:.1f} s)")
    for mode in modes:
        row = out[mode.label] = mode.result()
        row["ratio"] = row["tok_s"] / base["tok_s"]
        row["identical"] = mode.tokens == modes[0].tokens
        row["step_cost_vs_off"] = ((row["seconds"] / row["steps"])
                                   / (base["seconds"] / base["steps"]))
        row["tokens_per_step"] = row["output_tokens"] / row["steps"]
        spec = row["spec"] or {}
        print(f"  {mode.label:14s} {row['tok_s']:6.1f} tok/s  x{row['ratio']:.2f}  "
              f"identical={row['identical']}  acceptance={spec.get('acceptance_rate', 0):.2f}"
              f"  tokens/step={row['tokens_per_step']:.2f}  step cost "
              f"x{row['step_cost_vs_off']:.2f}")
    del modes
    gc.collect()
    return out


# CPU flags that decide which kernels and dtypes run fast (DESIGN.md, section 7).
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_bf16", "amx_int8", "amx_tile")


def machine() -> dict:
    """CPU model, the flags in KEY_FLAGS it has, cores and load average."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in lines
                  if line.startswith("flags")), [])
    return {"cpu": model, "cpu_flags": [f for f in KEY_FLAGS if f in flags],
            "cores": os.cpu_count(), "load_average": os.getloadavg()}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32",
                   help="float32: greedy tokens are the same with and without drafts")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--copy-tokens", type=int, default=256)
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=640)
    p.add_argument("--sections", nargs="*", default=["copy", "chat", "batch", "draft"])
    p.add_argument("--num-prompts", type=int, default=5,
                   help="copy and chat prompts per single-stream section (1-5)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 prompts, 16 tokens")
    p.add_argument("--note", default=None, help="free text stored with the results "
                   "(e.g. what else ran on the machine)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.copy_tokens = args.chat_tokens = 16
        args.concurrency = 4
        args.num_prompts = min(args.num_prompts, 2)
    return args


def main() -> int:
    args = parse_args()
    off = {"speculative.method": "none"}
    ngram = {"speculative.method": "ngram", "speculative.num_speculative_tokens": args.k}
    fixed = {**ngram, "speculative.enable_adaptive": False}
    draft = {"speculative.method": "draft_model", "speculative.draft_model": args.model,
             "speculative.num_speculative_tokens": args.k}
    copies = [[c] for c in copy_messages()[:args.num_prompts]]
    chats = [[c] for c in chat_messages()[:args.num_prompts]]
    # distinct prompts (numbered), so the prefix cache does not serve whole prompts
    batch = [[{"role": "user", "content": f"({i + 1}) {CHATS[i % len(CHATS)]}"}]
             for i in range(args.concurrency)]
    results: dict = {"machine": machine(), "args": vars(args), "note": args.note}
    print(f"machine: {results['machine']}")
    plan = {
        "copy": ("copy-heavy, single stream", {"off": off, "ngram": ngram}, copies,
                 args.copy_tokens),
        "chat": ("free-form chat, single stream",
                 {"off": off, "ngram adaptive": ngram, "ngram fixed k": fixed}, chats,
                 args.chat_tokens),
        "batch": (f"{args.concurrency} concurrent chat requests",
                  {"off": off, "ngram adaptive": ngram}, [batch, batch], args.chat_tokens),
        "draft": ("draft_model (the model as its own draft), copy prompts",
                  {"off": off, "draft_model": draft}, copies, args.copy_tokens),
        "structured": ("JSON-schema constrained, single stream",
                       {"off": off, "ngram adaptive": ngram, "ngram fixed k": fixed},
                       constrained_batches(args.num_prompts), args.chat_tokens)}
    for name in args.sections:
        results[name] = section(args, *plan[name])
        results["machine"]["load_average_end"] = os.getloadavg()
        if args.json:  # after every section: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(f"results: {args.json}")
    return 0


CHATS = [c[0]["content"] for c in chat_messages()]

if __name__ == "__main__":
    sys.exit(main())
