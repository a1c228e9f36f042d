"""Offline throughput: Folio's LLM against Hugging Face ``generate``, same run, same model.

Workload (fixed seed): N requests with random prompt token ids of 32-512 tokens and
output lengths of 32-256 tokens, ignore_eos, greedy. Both engines see the same
prompts, dtype and thread count. Hugging Face gets its best static batching: requests
sorted by output length then prompt length, left padding, batches of --hf-batch-size,
each batch generating exactly its longest requested output; only the requested tokens
count towards its throughput.

    .venv/bin/python benchmarks/offline_throughput.py --dtype bfloat16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_facts  # noqa: E402


def make_workload(n, seed, prompt_range, output_range, vocab_size):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = rng.randint(*prompt_range)
        # avoid special tokens (the first few ids of the vocabulary)
        reqs.append(([rng.randrange(100, vocab_size) for _ in range(p)],
                     rng.randint(*output_range)))
    return reqs


def run_folio(reqs, args):
    from folio import LLM, SamplingParams
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=1024, enable_prefix_caching=False,
              kv_cache_bytes=int(args.kv_cache_gib * 1024 ** 3),
              **{"observability.log_level": "warning",
                 "worker.prefill_attention": getattr(args, "prefill_attention", "sdpa")})
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
              for _, out in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(out for _, out in reqs), "folio produced the wrong token count"
    del llm
    return {"seconds": elapsed, "output_tokens": num_out}


def load_hf_model(model_arg: str, dtype):
    """The same model through transformers: a GGUF dequantised (to float32, then
    ``dtype``), a checkpoint folder as stored."""
    from transformers import AutoModelForCausalLM
    from model_files.paths import is_gguf_file, resolve_model_path
    path = resolve_model_path(model_arg)
    if is_gguf_file(path):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(dtype).eval()


def hf_static_batch_generate(model, reqs, batch_size: int) -> dict:
    """Hugging Face ``generate`` at its best static batching, on the model's device:
    requests sorted by output then prompt length, left padding, each batch generating
    exactly its longest requested output; only requested tokens count."""
    device = model.device
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i][1], len(reqs[i][0])))
    pad = 0
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for batch in batches:
            longest = max(len(reqs[i][0]) for i in batch)
            ids = torch.full((len(batch), longest), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                p = reqs[i][0]
                ids[row, longest - len(p):] = torch.tensor(p)
                mask[row, longest - len(p):] = 1
            new = max(reqs[i][1] for i in batch)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=pad)
            assert out.shape[1] == longest + new
            useful += sum(reqs[i][1] for i in batch)
    sync()
    return {"seconds": time.perf_counter() - t0, "output_tokens": useful,
            "batch_size": batch_size}


def run_hf(reqs, args, dtype):
    return hf_static_batch_generate(load_hf_model(args.model, dtype), reqs,
                                    args.hf_batch_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="none", choices=["none", "auto"],
                    help="Folio's model.quantization (auto: a quantized GGUF stays "
                         "quantized); HF always runs the dequantised weights in --dtype")
    ap.add_argument("--prefill-attention", default="sdpa", choices=["sdpa", "native", "amx"],
                    help="Folio's worker.prefill_attention (native: its own prompt kernel; "
                         "amx: the older name)")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0,
                    help="Folio's KV-cache budget (4 GiB holds the whole workload at once)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    reqs = make_workload(args.num_requests, args.seed, args.prompt_len, args.output_len, 49152)
    result = {"workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                           "output_len": args.output_len, "seed": args.seed,
                           "prompt_tokens": sum(len(p) for p, _ in reqs),
                           "output_tokens": sum(o for _, o in reqs)},
              "model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "prefill_attention": args.prefill_attention,
              "threads": args.threads,
              "machine": machine_facts()}
    result["folio"] = run_folio(reqs, args)
    result["folio"]["output_tok_s"] = result["folio"]["output_tokens"] / result["folio"]["seconds"]
    print(f"folio : {result['folio']['output_tok_s']:8.1f} output tok/s "
          f"({result['folio']['seconds']:.1f} s)", flush=True)
    if not args.skip_hf:
        hf = run_hf(reqs, args, dtype)
        hf["output_tok_s"] = hf["output_tokens"] / hf["seconds"]
        result["hf_generate"] = hf
        result["ratio"] = result["folio"]["output_tok_s"] / hf["output_tok_s"]
        print(f"HF    : {hf['output_tok_s']:8.1f} output tok/s ({hf['seconds']:.1f} s, "
              f"batch {args.hf_batch_size})")
        print(f"ratio : {result['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
