"""The GPU check's bookkeeping: the machine's facts first, one JSON summary last.

    python benchmarks/gpu_check_report.py env WORK/env.json
    python benchmarks/gpu_check_report.py record WORK NAME STATUS RC SECONDS NOTE
    python benchmarks/gpu_check_report.py summary WORK MODE [OUT]

``summary`` gathers what the sections left in WORK (sections/*.json, wheels.json,
compile.jsonl, parity.json, bench_*.json, lora_bench.json), prints a table and then the
headline as one JSON object (the last thing the check prints), writes everything to
OUT/gpu_check.json when OUT is given, and exits 1 unless every section passed or was
skipped.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys
from pathlib import Path

PACKAGES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "PyYAML",
            "structlog", "gguf", "pytest", "pytest-xdist")


def env(path: str) -> None:
    import torch
    info = {"python": platform.python_version(), "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                    multiprocessors=p.multi_processor_count, cuda_version=torch.version.cuda)
    for name in PACKAGES:  # versions from metadata: importing them all would cost seconds
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = "missing"
    Path(path).write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))


def record(work: str, name: str, status: str, rc: str, seconds: str, note: str) -> None:
    Path(work, "sections").mkdir(parents=True, exist_ok=True)
    Path(work, "sections", f"{name}.json").write_text(json.dumps(
        {"name": name, "status": status, "rc": int(rc), "seconds": float(seconds),
         "note": note}))


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _compile_headline(rows: list[dict]) -> dict | None:
    if not rows:
        return None
    live = [r["live_matches"] for r in rows if "live_matches" in r]
    return {"kernels": len(rows), "max_registers": max(r["registers"] for r in rows),
            "spilling_16bit": sum(r["spill_stores"] > 0 for r in rows
                                  if {"bf16", "fp16"} & set(r["dtypes"])),
            "live_registers_match": f"{sum(live)}/{len(live)}" if live else None}


def _parity_headline(parity: dict | None) -> dict | None:
    if not parity:
        return None
    return {m["model"]: {"greedy_float32": {mode: f"{g['identical']}/{g['prompts']}"
                                            for mode, g in m["greedy_float32"].items()},
                         "bf16_rel_rms": m["bf16_logits"]["rel_rms"],
                         "bf16_ratio_to_hf_bf16": m["bf16_logits"]["ratio_to_hf_bf16"],
                         "ok": m["ok"]} for m in parity["models"]}


def _bench_headline(bench: dict) -> dict:
    out = {}
    for name, b in bench.items():
        row = {"model": b["model"], "folio_tok_s": round(b["folio"]["output_tok_s"], 1),
               "cuda_graph_memory_mib": b.get("cuda_graph_memory_mib"),
               "decode_step_ms": {size: {k: v for k, v in r.items() if k != "parts"}
                                  for size, r in b["decode_step_ms"].items()}}
        if "hf_generate" in b:
            row.update(hf_tok_s=round(b["hf_generate"]["output_tok_s"], 1),
                       ratio_vs_hf=round(b["ratio_vs_hf"], 2))
        out[name] = row
    return out


def _lora_headline(lora: dict | None) -> dict | None:
    """lora_throughput.py's output tok/s and its two ratios (targets 0.70 and 2.0)."""
    if not lora:
        return None
    return {"tok_s": {k: round(lora[k]["tok_s"], 1) for k in ("base", "mixed", "naive")},
            "mixed_vs_base": round(lora["mixed_vs_base"], 3),
            "mixed_vs_naive": round(lora["mixed_vs_naive"], 2)}


def summary(work: str, mode: str, out: str = "") -> int:
    work_dir = Path(work)
    records = sorted((work_dir / "sections").glob("*.json"), key=lambda p: p.stat().st_mtime)
    sections = {p.stem: _load(p) for p in records}  # in the order they ran
    compile_rows = [json.loads(line) for line in (work_dir / "compile.jsonl").read_text()
                    .splitlines() if line.startswith("{")] \
        if (work_dir / "compile.jsonl").is_file() else []
    bench = {p.stem.removeprefix("bench_"): _load(p) for p in sorted(work_dir.glob("bench_*.json"))}
    wheels = _load(work_dir / "wheels.json")
    env_info = _load(work_dir / "env.json") or {}
    ok = bool(sections) and all(s["status"] in ("passed", "skipped") for s in sections.values())
    headline = {
        "ok": ok, "mode": mode, "device": env_info.get("gpu", "cpu"),
        "sections": {name: s["status"] for name, s in sections.items()},
        "wheels": wheels and {"files": len(wheels["wheels"]),
                              "wheels_mib": round(wheels["folder_bytes"] / 2 ** 20, 2),
                              "with_tree_mib": round(wheels["total_bytes"] / 2 ** 20, 2),
                              "ok": wheels["ok"]},
        "compile": _compile_headline(compile_rows),
        "parity": _parity_headline(_load(work_dir / "parity.json")),
        "bench": _bench_headline(bench),
        "lora": _lora_headline(_load(work_dir / "lora_bench.json"))}
    print("\n=== summary ===")
    for name, s in sections.items():
        print(f"{name:12s} {s['status']:8s} {s['seconds']:7.1f} s  {s['note']}")
    if out:
        details = {"headline": headline, "env": env_info, "sections": sections,
                   "wheels": wheels, "compile": compile_rows,
                   "parity": _load(work_dir / "parity.json"), "bench": bench,
                   "lora": _load(work_dir / "lora_bench.json")}
        Path(out, "gpu_check.json").write_text(json.dumps(details, indent=2) + "\n")
        print(f"results: {out}/gpu_check.json")
    print(json.dumps(headline, indent=1), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "env":
        env(*rest)
    elif command == "record":
        record(*rest)
    else:
        sys.exit(summary(*rest))
