"""Folio against Hugging Face ``generate`` on the same device, model and dtype (the GPU
check's bench), and Folio's decode step time with and without CUDA graphs.

1. Offline throughput on mixed lengths: Folio's LLM against Hugging Face ``generate``
   at its best static batching (see offline_throughput.py); both warmed up first.
2. Decode step time at each ``--decode-batch`` size, with CUDA graphs (when captured)
   and eagerly: the whole step as a server runs it (build the batch, forward pass,
   logits, sampling on the device at temperature 0.8 / top-p 0.95, the sampled ids
   copied to the host), median over ``--decode-iters``; with its parts (forward pass
   synchronised, then sampling and the copy).

Models: a random_checkpoints.py shape written on the spot in the bench dtype
(``smollm2-random``, ``tinyllama-random`` ~1.1B, ``llama3-random``, ``tiny``; ``--small``
for their 2-layer versions), or a checkpoint folder.

    python benchmarks/gpu_bench.py --model tinyllama-random --json out.json
    python benchmarks/gpu_bench.py --model smollm2-random --small --num-requests 8
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_parity import load_hf  # noqa: E402
from offline_throughput import hf_static_batch_generate, make_workload  # noqa: E402
from random_checkpoints import ARCHS, write_checkpoint  # noqa: E402


def prepare_model(args, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """(checkpoint folder, label); random shapes are written under a temporary folder."""
    if args.model not in ARCHS:
        return args.model, args.model
    folder = Path(tempfile.mkdtemp(prefix="folio-bench-")) / args.model
    write_checkpoint(args.model, folder, small=args.small, dtype=dtype, device=device)
    return str(folder), args.model + (" (small)" if args.small else "") + " (random weights)"


def run_folio(llm, reqs) -> dict:
    from folio import SamplingParams
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (kernels compile)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(n for _, n in reqs), "folio produced the wrong token count"
    return {"seconds": seconds, "output_tokens": num_out, "output_tok_s": num_out / seconds}


def _decode_states(runner, batch_size: int, context: int) -> list:
    """Requests of ``context`` cached tokens, each on its own blocks, about to decode."""
    from engine_core.worker_sampling import WorkerSamplingParams
    from worker.request_state import CachedRequestState
    per_req = -(-(context + 1) // runner.block_size)
    rng, vocab = random.Random(0), runner.arch.vocab_size
    params = WorkerSamplingParams(temperature=0.8, top_p=0.95)
    return [CachedRequestState(f"d{i}", [rng.randrange(3, vocab) for _ in range(context + 1)],
                               context, params,
                               list(range(1 + i * per_req, 1 + (i + 1) * per_req)), context,
                               None) for i in range(batch_size)]


def _timed_step(runner, states) -> tuple[float, float, float]:
    """(whole step, forward, sampling + copy) in seconds, the device synchronised."""
    from worker.input_batch import build_input_batch
    t0 = time.perf_counter()
    batch = build_input_batch(states, [1] * len(states), runner.block_size,
                              runner.arch.sliding_window, runner.attention_backend)
    hidden = runner.forward(batch)
    logits = runner.model.compute_logits(hidden[batch.logits_indices])
    runner.synchronize()
    t1 = time.perf_counter()
    runner.sample(batch.sampling_states, logits)  # ends with the ids on the host
    t2 = time.perf_counter()
    return t2 - t0, t1 - t0, t2 - t1


def decode_step_ms(llm, batch_sizes: list[int], context: int, iters: int,
                   warmup: int = 3) -> dict:
    """Median whole-step time per batch size and mode, with the parts' medians."""
    runner = llm.runner
    states = _decode_states(runner, max(batch_sizes), context)
    graphs, results = runner.cuda_graphs, {}
    with torch.inference_mode():
        for b in batch_sizes:
            row, parts = {}, {}
            for mode, g in (("cuda_graphs", graphs), ("eager", None)):
                if mode == "cuda_graphs" and g is None:
                    continue
                runner.cuda_graphs = g
                for _ in range(warmup):
                    _timed_step(runner, states[:b])
                times = [_timed_step(runner, states[:b]) for _ in range(iters)]
                step, forward, sample = (statistics.median(t) * 1000 for t in zip(*times))
                row[mode] = round(step, 3)
                parts[mode] = {"forward": round(forward, 3), "sample": round(sample, 3)}
            results[str(b)] = row | {"parts": parts}
            print(f"decode batch {b:4d}: " + ", ".join(
                f"{m} {row[m]:.3f} ms (forward {p['forward']:.3f}, sample {p['sample']:.3f})"
                for m, p in parts.items()), flush=True)
    runner.cuda_graphs = graphs
    return results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-random")
    ap.add_argument("--small", action="store_true", help="the 2-layer version (CPU)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-iters", type=int, default=30)
    ap.add_argument("--decode-warmup", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def build_llm(args, path: str, dtype: torch.dtype, device: torch.device):
    """Folio sized for the workload: the decode batches fit, KV for the longest request."""
    from folio import LLM
    max_len = max(args.prompt_len[1] + args.output_len[1], args.decode_context + 1)
    max_seqs = max(args.decode_batch + [64])
    per_req = -(-(max_len + 1) // 16)
    memory = ({"gpu_memory_utilization": 0.5} if device.type == "cuda"  # HF comes later
              else {"num_blocks": 1 + max(max_seqs * per_req, 4 * per_req)})
    return LLM(model=path, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max_seqs,
               max_model_len=max_len, enable_prefix_caching=False, block_size=16,
               attention_backend=args.attention_backend,
               **memory, **{"observability.log_level": "warning"})


def run_hf(args, path: str, dtype: torch.dtype, device: torch.device, reqs) -> dict:
    model = load_hf(path, dtype, device)
    hf_static_batch_generate(model, [(reqs[0][0][:8], 4)] * 2, 2)  # warm-up
    hf = hf_static_batch_generate(model, reqs, args.hf_batch_size)
    hf["output_tok_s"] = hf["output_tokens"] / hf["seconds"]
    return hf


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    path, label = prepare_model(args, dtype, device)
    llm = build_llm(args, path, dtype, device)
    runner = llm.runner
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": label, "dtype": str(dtype), "torch": torch.__version__,
              "attention_backend": runner.attention_backend.name,
              "cuda_graphs": runner.cuda_graphs is not None,
              "num_kv_blocks": runner.kv_caches[0].shape[1],
              "cuda_graph_memory_mib": {
                  "reserved_in_kv_budget": round(runner.graph_reserve_bytes / 2 ** 20, 1),
                  "used": round(getattr(runner.cuda_graphs, "memory_bytes", 0) / 2 ** 20, 1)}}
    vocab = runner.arch.vocab_size
    reqs = make_workload(args.num_requests, 0, args.prompt_len, args.output_len, vocab)
    result["folio"] = run_folio(llm, reqs)
    print(f"folio : {result['folio']['output_tok_s']:9.1f} output tok/s", flush=True)
    result["decode_step_ms"] = decode_step_ms(llm, args.decode_batch, args.decode_context,
                                              args.decode_iters, args.decode_warmup)
    del llm, runner  # free the KV pool and graphs before Hugging Face takes the device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        hf = result["hf_generate"] = run_hf(args, path, dtype, device, reqs)
        result["ratio_vs_hf"] = result["folio"]["output_tok_s"] / hf["output_tok_s"]
        print(f"HF    : {hf['output_tok_s']:9.1f} output tok/s (batch {args.hf_batch_size})\n"
              f"ratio : {result['ratio_vs_hf']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
