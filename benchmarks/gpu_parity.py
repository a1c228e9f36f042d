"""Folio against Hugging Face on random-weight checkpoints, on whatever device is there.

For each model (random_checkpoints.py writes it with the transformers at hand):

1. Greedy float32: ``--prompts`` prompts of random token ids, ``--tokens`` tokens each.
   Hugging Face ``generate`` (batch 1, no padding, no end token) against Folio through
   CUDA graphs and eagerly (``enforce_eager``; on a CPU there is only the eager path):
   identical token for token. A mismatch reports Hugging Face's top-2 logit gap where
   it happened, to tell a near-tie from a bug.
2. bf16 logits: the prompts' last-position logits from Folio in bfloat16 against
   Hugging Face's in float32. Tolerance: their RMS difference at most 10% of the
   float32 logits' standard deviation, and at most 1.5x the RMS difference of Hugging
   Face's own bfloat16 run (measured on the CPU at full size: Folio 0.080 vs HF 0.080,
   6.6% of a 1.2 std on smollm2-random; 0.088 vs 0.088, 5.5% on llama3-random).

Prints the results as JSON (``--json`` writes them too); exits 1 on any failure.

    python benchmarks/gpu_parity.py --json parity.json
    python benchmarks/gpu_parity.py --small --prompts 3 --tokens 8      # a CPU's pace
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from random_checkpoints import write_checkpoint  # noqa: E402

REL_RMS_TOLERANCE = 0.10  # bf16 vs float32 logits, relative to the logits' std
HF_RATIO_TOLERANCE = 1.5  # ... and relative to Hugging Face's own bf16 error


def load_hf(path: str, dtype: torch.dtype, device: torch.device):
    """A Hugging Face model that generates exactly what it is asked (no end token)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompts: list[list[int]], num_tokens: int):
    """Greedy continuations (batch 1) and, per step, the gap between the top two logits."""
    tokens, gaps = [], []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p], device=model.device),
                                 max_new_tokens=num_tokens, do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            gaps.append([float(s[0].topk(2).values.diff().abs()) for s in out.scores])
    return tokens, gaps


def hf_last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([p], device=model.device)).logits[0, -1]
                            for p in prompts]).float().cpu()


def folio_greedy(llm, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    from folio import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def folio_last_logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    """One eager prefill step of every prompt on the runner's cache; last-position logits."""
    from engine_core.worker_sampling import WorkerSamplingParams
    from worker.input_batch import build_input_batch
    from worker.request_state import CachedRequestState
    states, next_block = [], 1
    for i, p in enumerate(prompts):
        num = -(-len(p) // runner.block_size)
        states.append(CachedRequestState(f"p{i}", list(p), len(p), WorkerSamplingParams(),
                                         list(range(next_block, next_block + num)), 0, None))
        next_block += num
    batch = build_input_batch(states, [len(p) for p in prompts], runner.block_size,
                              runner.arch.sliding_window, runner.attention_backend)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.forward(batch)[batch.logits_indices])
    order = [int(s.req_id[1:]) for s in batch.sampling_states]
    return logits.cpu()[torch.tensor(order).argsort()]


def compare(ours: list[list[int]], ref: list[list[int]], gaps: list[list[float]]) -> dict:
    """How many continuations match, where the others first differ and how close
    Hugging Face's top two were there."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
             for x, y in zip(ours, ref)]
    return {"prompts": len(ours), "identical": sum(d is None for d in first),
            "first_difference": first,
            "hf_top2_gap_there": [None if d is None else round(g[d], 6)
                                  for d, g in zip(first, gaps)]}


def logit_errors(ours: torch.Tensor, ref: torch.Tensor, hf_bf16: torch.Tensor) -> dict:
    rms = (ours - ref).pow(2).mean().sqrt().item()
    hf_rms = (hf_bf16 - ref).pow(2).mean().sqrt().item()
    rel, ratio = rms / ref.std().item(), rms / max(hf_rms, 1e-12)
    return {"rms": round(rms, 5), "max_abs": round((ours - ref).abs().max().item(), 5),
            "rel_rms": round(rel, 5), "hf_bf16_rms": round(hf_rms, 5),
            "ratio_to_hf_bf16": round(ratio, 3),
            "top1_agree": int((ours.argmax(-1) == ref.argmax(-1)).sum()),
            "ok": rel <= REL_RMS_TOLERANCE and ratio <= HF_RATIO_TOLERANCE}


def build_llm(path: str, dtype: str, device: torch.device, max_len: int, num_seqs: int,
              enforce_eager: bool):
    """Folio sized for the prompts alone (no profiling of the whole GPU)."""
    from folio import LLM
    blocks = 1 + num_seqs * -(-(max_len + 1) // 16)
    return LLM(model=path, dtype=dtype, max_num_seqs=num_seqs, max_model_len=max_len,
               num_blocks=blocks, block_size=16, enable_prefix_caching=False,
               enforce_eager=enforce_eager, **{"observability.log_level": "warning"})


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_model(name: str, args, device: torch.device, workdir: Path) -> dict:
    path = str(write_checkpoint(name, workdir / name, small=args.small, device=device))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.prompts)]
    hf = load_hf(path, torch.float32, device)
    ref_tokens, gaps = hf_greedy(hf, prompts, args.tokens)
    ref_logits = hf_last_logits(hf, prompts)
    hf_bf16 = hf_last_logits(hf.to(torch.bfloat16), prompts)
    del hf
    _free(device)
    result = {"model": name + (" (small)" if args.small else ""), "greedy_float32": {}}
    max_len = args.prompt_len[1] + args.tokens + 1
    modes = {"cuda_graphs": False, "eager": True} if device.type == "cuda" else {"eager": True}
    for mode, eager in modes.items():
        llm = build_llm(path, "float32", device, max_len, args.prompts, eager)
        assert (llm.runner.cuda_graphs is not None) == (mode == "cuda_graphs")
        result["greedy_float32"][mode] = compare(folio_greedy(llm, prompts, args.tokens),
                                                 ref_tokens, gaps)
        if eager:
            fp32 = folio_last_logits(llm.runner, prompts)
            result["float32_logits_max_abs"] = round((fp32 - ref_logits).abs().max().item(), 7)
        del llm
        _free(device)
    llm = build_llm(path, "bfloat16", device, max_len, args.prompts, True)
    result["bf16_logits"] = logit_errors(folio_last_logits(llm.runner, prompts), ref_logits,
                                         hf_bf16)
    del llm
    _free(device)
    result["ok"] = result["bf16_logits"]["ok"] and all(
        g["identical"] == g["prompts"] for g in result["greedy_float32"].values())
    return result


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-random", "llama3-random"])
    ap.add_argument("--small", action="store_true", help="2-layer versions (CPU)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workdir = Path(tempfile.mkdtemp(prefix="folio-parity-"))
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "tolerance": {"bf16_rel_rms": REL_RMS_TOLERANCE,
                             "bf16_ratio_to_hf_bf16": HF_RATIO_TOLERANCE},
               "models": [check_model(name, args, device, workdir) for name in args.models]}
    results["ok"] = all(m["ok"] for m in results["models"])
    text = json.dumps(results, indent=1)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
