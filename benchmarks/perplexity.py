"""Teacher-forced perplexity on a fixed text: quantized weights against the dequantised
float32 model (``--configs weights``), or a quantized KV cache against the model dtype's
(``--configs kv``), same run, same tokens.

The text (``benchmarks/data/perplexity_text.txt``, an essay written for this benchmark,
2,070 tokens with SmolLM2's tokenizer) is run as one prompt; every position's logits
score the next token, and perplexity is ``exp(mean negative log-likelihood)``. Each
configuration is a full Folio model (``model.quantization`` x ``model.dtype`` x
``worker.linear_backend`` x ``memory.kv_cache_dtype``); the first is the reference and the
others are reported relative to it. An fp8 KV cache is felt even though the text is one
prefill: attention rounds this step's keys and values through the cache format, exactly
as a later step reads them back (kernels/kv_quant.py). llama.cpp's own ``llama-perplexity`` scores the same text and GGUF beside
them when benchmarks/llamacpp.py has built it (or ``--llama-perplexity BIN`` names one);
its windows differ: it reports its own context length.

    .venv/bin/python benchmarks/perplexity.py --json benchmarks/results/perplexity.json
    .venv/bin/python benchmarks/perplexity.py --configs kv \
        --json benchmarks/results/perplexity_kv_cache.json
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEXT = REPO / "benchmarks" / "data" / "perplexity_text.txt"
# (label, quantization, dtype, linear backend[, kv cache dtype]); the first is the reference
CONFIGS = [
    ("dequantised float32", "none", "float32", "auto"),
    ("quantized, float32 activations, measured kernels", "auto", "float32", "auto"),
    ("quantized, int8 route everywhere, float32", "auto", "float32", "int8"),
    ("quantized, widening route everywhere, float32", "auto", "float32", "widen"),
    ("quantized, bfloat16 activations, measured kernels", "auto", "bfloat16", "auto"),
    ("quantized, int8 route everywhere, bfloat16", "auto", "bfloat16", "int8"),
    ("quantized, widening route everywhere, bfloat16", "auto", "bfloat16", "widen"),
    ("dequantised bfloat16", "none", "bfloat16", "auto"),
]
KV_CONFIGS = [
    ("bfloat16 model, bfloat16 KV cache", "none", "bfloat16", "auto", "auto"),
    ("bfloat16 model, fp8 (e4m3) KV cache", "none", "bfloat16", "auto", "fp8"),
    ("bfloat16 model, fp8_e5m2 KV cache", "none", "bfloat16", "auto", "fp8_e5m2"),
    ("bfloat16 model, int8 KV cache (scale per token and head)", "none", "bfloat16", "auto",
     "int8"),
    ("float32 model, float32 KV cache", "none", "float32", "auto", "auto"),
    ("float32 model, fp8 (e4m3) KV cache", "none", "float32", "auto", "fp8"),
]

# Candidate KV formats not built, emulated for comparison: the text is one
# prefill, so attention sees keys and values only through round_through_cache
# (kernels/paged_attention.py), which --configs kv-formats replaces by each rounding.


def _fp8_per_row(x, dtype=torch.float8_e4m3fn):
    # fp8 with a scale per token and head (its largest |x| maps to the format's max)
    a = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.finfo(dtype).max
    return (x.float() / a).to(dtype).float().mul(a).to(x.dtype)


EMULATED_KV = {
    "fp8 e4m3, one scale per token and head (emulated)": _fp8_per_row,
}


@torch.inference_mode()
def negative_log_likelihoods(runner, token_ids: list[int], chunk: int = 256) -> torch.Tensor:
    """NLL of token i+1 given tokens 0..i, for every i, from one prefill of the text."""
    from engine_core.worker_sampling import WorkerSamplingParams
    from worker.input_batch import build_input_batch
    from worker.kv_cache import KVCacheSpec, allocate_kv_cache
    from worker.request_state import CachedRequestState
    block = 16
    num_blocks = -(-len(token_ids) // block)
    caches = allocate_kv_cache(KVCacheSpec.for_model(runner.arch, block, runner.kv_cache_dtype),
                               num_blocks + 1, runner.device)
    state = CachedRequestState("ppl", list(token_ids), len(token_ids), WorkerSamplingParams(),
                               list(range(1, num_blocks + 1)), 0, None)
    batch = build_input_batch([state], [len(token_ids)], block, runner.arch.sliding_window,
                              runner.attention_backend)
    hidden = runner.model(batch.input_ids, batch.positions, caches, batch.attn)
    targets = torch.tensor(token_ids[1:])
    out = []
    for start in range(0, len(token_ids) - 1, chunk):
        logits = runner.model.compute_logits(hidden[start:start + chunk][:len(targets) - start])
        out.append(torch.nn.functional.cross_entropy(
            logits.float(), targets[start:start + chunk], reduction="none"))
    return torch.cat(out)


def score(label, quantization, dtype, backend, kv_cache_dtype, token_ids, model):
    from folio import LLM
    started = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, quantization=quantization, max_model_len=4096,
              num_blocks=300, kv_cache_dtype=kv_cache_dtype,
              **{"worker.linear_backend": backend, "observability.log_level": "warning"})
    nll = negative_log_likelihoods(llm.runner, token_ids)
    result = {"label": label, "quantization": llm.runner.quantization, "dtype": dtype,
              "linear_backend": backend, "kv_cache_dtype": kv_cache_dtype,
              "perplexity": math.exp(nll.mean().item()),
              "mean_nll": nll.mean().item(), "tokens_scored": nll.numel(),
              "seconds": time.perf_counter() - started}
    print(f"{label:52s} ppl {result['perplexity']:8.4f}", flush=True)
    return result


def emulated_kv_formats(token_ids, model) -> list[dict]:
    """The bfloat16 model with attention over keys and values rounded as EMULATED_KV."""
    import kernels.paged_attention as attention
    built = attention.round_through_cache
    out = []
    try:
        for label, rounding in EMULATED_KV.items():
            attention.round_through_cache = lambda x, _dtype, f=rounding: f(x)
            out.append(score(f"bfloat16 model, {label}", "none", "bfloat16", "auto", "auto",
                             token_ids, model))
    finally:
        attention.round_through_cache = built
    return out


def llama_perplexity(binary: Path, gguf: Path, threads: int) -> dict:
    """llama.cpp's ``llama-perplexity`` on the same text and file (its own windows)."""
    proc = subprocess.run([str(binary), "-m", str(gguf), "-f", str(TEXT), "-t", str(threads),
                           "-c", "1024", "-b", "1024"], capture_output=True, text=True,
                          timeout=900)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if not match:
        raise RuntimeError("llama-perplexity gave no estimate:\n" + proc.stderr[-2000:])
    return {"label": "llama.cpp llama-perplexity (context 1024)",
            "perplexity": float(match.group(1))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--llama-perplexity", type=Path, default=None,
                    help="llama.cpp's llama-perplexity binary (default: the one "
                         "benchmarks/llamacpp.py built, if any)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", choices=["weights", "kv"], default="weights",
                    help="weights: quantized weights vs float32 (and llama.cpp); kv: fp8 KV "
                         "caches vs the model dtype's")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from benchmarks.machine import machine_facts
    from model_files.paths import resolve_model_path
    from text.tokenizer import Tokenizer
    token_ids = Tokenizer.from_model_path(args.model).encode(TEXT.read_text())
    configs = CONFIGS if args.configs == "weights" else KV_CONFIGS
    results = [score(*config[:4], config[4] if len(config) > 4 else "auto", token_ids,
                     args.model) for config in configs]
    if args.configs == "kv":
        results += emulated_kv_formats(token_ids, args.model)
    # weights: everything against the first; kv: each against its model dtype's own cache
    references = {r["dtype"]: r["perplexity"] for r in reversed(results)
                  if r["kv_cache_dtype"] == "auto"} if args.configs == "kv" else {}
    for r in results:
        reference = references.get(r["dtype"], results[0]["perplexity"])
        r["relative_to_reference"] = r["perplexity"] / reference - 1
        print(f"{r['label']:52s} {100 * r['relative_to_reference']:+6.2f}% vs reference")
    from benchmarks.llamacpp import binary
    binary_path = (args.llama_perplexity or binary("llama-perplexity")
                   if args.configs == "weights" else None)
    if binary_path:
        results.append(llama_perplexity(binary_path,
                                        resolve_model_path(args.model), args.threads))
        print(f"{results[-1]['label']:52s} ppl {results[-1]['perplexity']:8.4f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_facts(), "text": TEXT.name,
                                         "tokens": len(token_ids), "results": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
