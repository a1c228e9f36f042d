"""Decode step time against the roofline of the model's linear layers, same run.

The roofline for a decode step at batch B is the time the model's linear layers alone
take on B rows (q/k/v, o, gate/up and down in every layer, plus the LM head): every
decode step must run those matmuls, so ``B / linear_seconds`` is the most tokens per
second a step could produce. Two linear paths are timed and the faster one counts:
plain ``F.linear`` in the model's dtype, and Folio's ``worker.models.linear`` (which
widens 16-bit weights to float32 on CPUs without 16-bit arithmetic), both on the
weights as the model holds them (K-major on the CPU, see worker/models/linear.py).

The decode side runs the real engine: B requests with ``--context`` prompt tokens are
prefilled, then only steps where all B requests decode one token are timed (the whole
``EngineCore.step()``: scheduling, batch building, forward, sampling, bookkeeping).

    .venv/bin/python benchmarks/decode_roofline.py --dtype bfloat16 --batch-sizes 32 64 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def linear_layers(model):
    """(weight, bias) of every matmul a decode step runs, in model order."""
    out = []
    for layer in model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj, layer.mlp.down_proj):
            out.append((mod.weight, mod.bias))
    head = model.head_weight  # the LM head as compute_logits reads it
    if head is None:
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    out.append((head, None))
    return out


@torch.inference_mode()
def time_linears(layers, batch, dtype, fn, repeats):
    """Best-of-``repeats`` seconds for one pass over all layers at ``batch`` rows."""
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]).to(dtype) for w, _ in layers}
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for w, b in layers:
            fn(xs[w.shape[1]], w, b)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def time_decode_steps(llm, batch, context, steps):
    """Seconds of each engine step in which exactly ``batch`` requests decode."""
    from engine_core.outputs import ModelRunnerOutput
    from folio import SamplingParams
    engine = llm.engine
    # requests finish prefill over several steps; enough tokens that all B then decode
    # together for ``steps`` steps
    prefill_steps = -(-batch * context // llm.config.scheduler.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0.0, max_tokens=steps + prefill_steps + 1,
                            ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (i * 7919 + j * 31) % 40000 for j in range(context)]
        engine.add_request(f"roof-{batch}-{i}", prompt, params)
    decode_times = []
    while engine.has_unfinished_requests():
        so = engine.begin_step()
        t0 = time.perf_counter()
        out = engine.executor.execute_model(so) if engine.needs_worker(so) else None
        engine.end_step(so, out or ModelRunnerOutput())
        elapsed = time.perf_counter() - t0
        is_pure_decode = (len(so.num_scheduled_tokens) == batch
                          and so.total_num_scheduled_tokens == batch)
        if is_pure_decode:
            decode_times.append(elapsed)
    return decode_times[:steps]


def run(args):
    from folio import LLM
    from worker.models.linear import linear
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=2048, max_model_len=args.context + args.steps + 64,
              enable_prefix_caching=False, kv_cache_bytes=int(args.kv_cache_gib * 1024 ** 3),
              **{"observability.log_level": "warning"})
    model, dtype = llm.runner.model, llm.runner.dtype
    layers = linear_layers(model)
    rows = []
    for batch in args.batch_sizes:
        plain = time_linears(layers, batch, dtype, F.linear, args.repeats)
        folio_path = time_linears(layers, batch, dtype, linear, args.repeats)
        roofline = min(plain, folio_path)
        steps = time_decode_steps(llm, batch, args.context, args.steps)
        step = statistics.median(steps)
        row = {"batch": batch, "linear_seconds_torch": plain,
               "linear_seconds_folio": folio_path,
               "roofline_tok_s": batch / roofline, "decode_step_seconds": step,
               "decode_step_seconds_all": steps, "decode_tok_s": batch / step,
               "fraction_of_roofline": roofline / step}
        rows.append(row)
        print(f"batch {batch:4d}: linears torch {plain * 1e3:7.1f} ms, folio "
              f"{folio_path * 1e3:7.1f} ms -> roofline {batch / roofline:7.1f} tok/s | "
              f"decode step {step * 1e3:7.1f} ms -> {batch / step:7.1f} tok/s | "
              f"{100 * roofline / step:5.1f}% of roofline", flush=True)
    return {"dtype": str(dtype), "context": args.context, "threads": torch.get_num_threads(),
            "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64, 128])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per batch")
    ap.add_argument("--repeats", type=int, default=3, help="linear-layer passes (best)")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
