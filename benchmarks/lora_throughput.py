"""Multi-LoRA throughput: one batch mixing adapters against the base model and against
serving one adapter's requests at a time (the naive way), same run, default model.

Workload (fixed seed): N requests with random prompts of 16-256 tokens and outputs of
32-128 tokens, ignore_eos, greedy, prefix caching off (the three passes reuse prompts).
Adapters: K random PEFT LoRA adapters (rank R on all seven projections of every layer,
written in PEFT's safetensors layout), request i on adapter i % K.

    base    all N requests on the base model, one generate() call
    mixed   all N requests, each on its adapter, one generate() call (one batch)
    naive   one generate() call per adapter with its N/K requests, one after another

Output tok/s = generated tokens / wall time of the pass. Targets (issue 15): mixed
>= 70% of base, and >= 2x naive. The machine's CPU and load go in the results.

    .venv/bin/python benchmarks/lora_throughput.py --json benchmarks/results/lora_throughput.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, arch, rank: int, seed: int) -> Path:
    """A random LoRA adapter in PEFT's on-disk layout (what save_pretrained writes)."""
    from safetensors.torch import save_file
    from worker.lora.lora_targets import module_shapes
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module, (fan_in, fan_out) in module_shapes(arch).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
        "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None}))
    return folder


def make_workload(n: int, seed: int, prompt_range, output_range, vocab_size: int):
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))],
             rng.randint(*output_range)) for _ in range(n)]


def timed(llm, reqs, lora_requests) -> dict:
    from folio import SamplingParams
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
              for _, out in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    seconds = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(out for _, out in reqs), "wrong number of generated tokens"
    return {"seconds": seconds, "output_tokens": num_out, "tok_s": num_out / seconds}


def run(args) -> dict:
    from folio import LLM, LoRARequest
    from random_checkpoints import ARCHS, write_checkpoint
    tmp = Path(tempfile.mkdtemp(prefix="folio-lora-bench-"))
    model = args.model  # "default", a path, or a random checkpoint in a real model's shape
    if model in ARCHS:
        model = str(write_checkpoint(model, tmp / model))
    llm = LLM(model=model, dtype=args.dtype, max_num_seqs=args.num_requests,
              max_model_len=1024, enable_prefix_caching=False, enable_lora=True,
              max_loras=args.num_adapters, max_cpu_loras=args.num_adapters,
              max_lora_rank=args.rank, **{"observability.log_level": "warning"})
    adapters = [LoRARequest(f"adapter-{k}", k + 1, str(write_adapter(
        tmp / f"adapter-{k}", llm.runner.arch, args.rank, k))) for k in range(args.num_adapters)]
    reqs = make_workload(args.num_requests, 0, args.prompt_len, args.output_len,
                         llm.runner.arch.vocab_size)
    per_request = [adapters[i % len(adapters)] for i in range(len(reqs))]
    timed(llm, reqs[:2], per_request[:2])  # warm-up: loads two adapters, first kernels
    results = {"base": timed(llm, reqs, None), "mixed": timed(llm, reqs, per_request)}
    naive = [timed(llm, [r for r, a in zip(reqs, per_request) if a is adapter], adapter)
             for adapter in adapters]
    seconds = sum(n["seconds"] for n in naive)
    num_out = sum(n["output_tokens"] for n in naive)
    results["naive"] = {"seconds": seconds, "output_tokens": num_out,
                        "tok_s": num_out / seconds}
    results["mixed_vs_base"] = results["mixed"]["tok_s"] / results["base"]["tok_s"]
    results["mixed_vs_naive"] = results["mixed"]["tok_s"] / results["naive"]["tok_s"]
    results["dtype"] = str(llm.runner.dtype).removeprefix("torch.")
    return results


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                  if line.startswith("flags")), [])
    # niceness and load: a run beside other jobs (a shared machine) reads slower
    return {"cpu": model, "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "nice": os.nice(0), "torch_threads": torch.get_num_threads(),
            "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx")))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct), a "
                   "model path, or a random checkpoint of benchmarks/random_checkpoints.py "
                   "(smollm2-random: the default's shape, where it is not installed; tiny)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    before = machine()
    results = {"args": vars(args), "machine": before, **run(args)}
    results["machine"]["load_avg_1m_after"] = os.getloadavg()[0]
    for name in ("base", "mixed", "naive"):
        r = results[name]
        print(f"{name:6s} {r['output_tokens']:6d} tokens {r['seconds']:7.1f} s "
              f"{r['tok_s']:7.1f} tok/s")
    print(f"mixed / base  = {results['mixed_vs_base']:.2f}  (target >= 0.70)")
    print(f"mixed / naive = {results['mixed_vs_naive']:.2f}  (target >= 2.00)")
    print(f"{results['dtype']}, {before['cpu']}, {before['cores']} cores, nice {before['nice']}, "
          f"load {before['load_avg_1m']:.2f} before, "
          f"{results['machine']['load_avg_1m_after']:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
