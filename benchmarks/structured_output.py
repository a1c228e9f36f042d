"""Structured outputs: what grammars cost, in one run on the default model.

1. Cold compile: each schema of tests/data/structured_output_schemas.json compiled once
   by llguidance against SmolLM2's tokenizer (first token mask included), as the worker
   does the first time it sees a grammar.
2. Throughput: N chat requests (temperature 0.8, seeded, ignore_eos, max_tokens L) all
   free, then the same N with every second one constrained by one of 8 schemas (cached:
   compiled by a warm-up), alternating the two loads --repeats times; best output tok/s
   of each and their ratio (target: constrained >= 0.90 x free). ignore_eos keeps both
   loads at exactly N x L tokens; a constrained row whose grammar ended keeps its mask
   (EOS only) until L.
3. --validity: the 50 schemas x 3 seeds (--validity-seeds) at temperature 0.8, unconstrained (the same
   prompts as the test, and again with the schema written into the prompt) and
   constrained: how many outputs parse and validate with jsonschema.

    .venv/bin/python benchmarks/structured_output.py --validity \
        --json benchmarks/results/structured_output.json
    .venv/bin/python benchmarks/structured_output.py --quick      # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCHEMAS = ROOT / "tests" / "data" / "structured_output_schemas.json"
# Eight schemas whose outputs run long (arrays of objects, several fields).
THROUGHPUT_SCHEMAS = ("order", "student_grades", "playlist", "coordinates_list", "recipe",
                      "team", "employee", "quiz")


def cold_compiles(entries: list[dict]) -> dict:
    """Milliseconds to compile each schema once (a fresh cache, the tokenizer built)."""
    from engine_core.structured_outputs import StructuredOutputsParams
    from text.grammar_compiler import GrammarCompiler
    from text.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_path("default")
    compiler = GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    compiler.ll_tokenizer
    tokenizer_ms = (time.perf_counter() - t0) * 1e3
    times = {}
    for entry in entries:
        spec = StructuredOutputsParams(json=entry["schema"]).spec
        t0 = time.perf_counter()
        compiler.compile(spec)
        times[entry["name"]] = round((time.perf_counter() - t0) * 1e3, 3)
    values = sorted(times.values())
    return {"tokenizer_build_ms": round(tokenizer_ms, 1), "per_schema_ms": times,
            "mean_ms": round(statistics.mean(values), 3),
            "p50_ms": round(statistics.median(values), 3), "max_ms": values[-1]}


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt + " Reply with JSON only."}]


def throughput(llm, entries: list[dict], args) -> dict:
    from engine_core.sampling_params import SamplingParams
    by_name = {e["name"]: e for e in entries}
    picked = [by_name[n] for n in THROUGHPUT_SCHEMAS]
    convs = [chat(picked[i // 2 % 8]["prompt"]) for i in range(args.num_requests)]

    def params(constrained: bool) -> list:
        return [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                               ignore_eos=True, structured_outputs={
                                   "json": picked[i // 2 % 8]["schema"]}
                               if constrained and i % 2 else None)
                for i in range(args.num_requests)]

    llm.chat(convs[:16], params(True)[:16], use_tqdm=False)  # warm-up: compiles the 8
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(args.repeats):
        for mode in ("free", "constrained"):
            t0 = time.perf_counter()
            outs = llm.chat(convs, params(mode == "constrained"), use_tqdm=False)
            seconds = time.perf_counter() - t0
            num = sum(len(o.outputs[0].token_ids) for o in outs)
            assert num == args.num_requests * args.max_tokens, num
            runs[mode].append(round(num / seconds, 2))
            print(f"  {mode}: {runs[mode][-1]} output tok/s", flush=True)
    best = {mode: max(v) for mode, v in runs.items()}
    return {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
            "num_constrained": args.num_requests // 2, "schemas": list(THROUGHPUT_SCHEMAS),
            "runs_tok_s": runs, "best_tok_s": best,
            "ratio": round(best["constrained"] / best["free"], 3)}


def validity(llm, entries: list[dict], args) -> dict:
    import jsonschema
    from engine_core.sampling_params import SamplingParams
    checker = jsonschema.FormatChecker()

    def count(with_schema_in_prompt: bool, constrained: bool) -> dict:
        convs, params, schemas = [], [], []
        for entry in entries:
            prompt = entry["prompt"] + (f" The JSON schema: {json.dumps(entry['schema'])}."
                                        if with_schema_in_prompt else "")
            for seed in range(args.validity_seeds):
                convs.append(chat(prompt))
                schemas.append(entry["schema"])
                params.append(SamplingParams(temperature=0.8, seed=seed, max_tokens=200,
                                             structured_outputs={"json": entry["schema"]}
                                             if constrained else None))
        outs = llm.chat(convs, params, use_tqdm=False)
        parsed = valid = 0
        for out, schema in zip(outs, schemas):
            try:
                value = json.loads(out.outputs[0].text)
            except ValueError:
                continue
            parsed += 1
            valid += jsonschema.Draft202012Validator(
                schema, format_checker=checker).is_valid(value)
        return {"outputs": len(outs), "parse": parsed, "valid": valid}

    kinds = {"unconstrained": (False, False), "unconstrained_schema_in_prompt": (True, False),
             "constrained": (False, True)}
    return {kind: count(*kinds[kind]) for kind in args.validity_kinds.split(",")}


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines()
                  if line.startswith("Flags")), [])
    load = Path("/proc/loadavg").read_text().split()[:3]
    return {"cpu": model, "cpu_flags": flags, "num_cpus": os.cpu_count(),
            "nice": os.nice(0), "load_average": load, "python": platform.python_version()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--validity", action="store_true",
                        help="also measure validity with and without constraints")
    parser.add_argument("--validity-seeds", type=int, default=3,
                        help="seeded samples per schema in --validity (the test uses 3)")
    parser.add_argument("--validity-kinds",
                        default="unconstrained,unconstrained_schema_in_prompt,constrained",
                        help="which of the three --validity runs to make")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 requests")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--note", default="",
                        help="recorded with the results (e.g. what else ran beside it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens, args.repeats = 8, 8, 1
    entries = json.loads(SCHEMAS.read_text())
    result = {"machine": machine(), "note": args.note, "argv": sys.argv[1:]}

    def save() -> None:  # after each phase: a run cut short keeps what it measured
        result["machine"]["load_average_after"] = Path("/proc/loadavg").read_text().split()[:3]
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")

    result["cold_compile"] = cold_compiles(entries)
    save()
    print("cold compile per schema (ms): mean {mean_ms}, p50 {p50_ms}, max {max_ms}; "
          "tokenizer build {tokenizer_build_ms}".format(**result["cold_compile"]), flush=True)
    from folio import LLM
    llm = LLM(dtype=args.dtype, **{"observability.log_level": "warning"})
    result["throughput"] = throughput(llm, entries, args)
    save()
    t = result["throughput"]
    print(f"output tok/s: free {t['best_tok_s']['free']}, half constrained "
          f"{t['best_tok_s']['constrained']}: ratio {t['ratio']} (target >= 0.90)", flush=True)
    if args.validity:
        result["validity"] = validity(llm, entries, args)
        save()
        print("validity:", json.dumps(result["validity"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
