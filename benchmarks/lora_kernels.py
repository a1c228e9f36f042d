"""The LoRA delta of one decoder layer on the CPU: which way to compute it.

SmolLM2's shapes (hidden 576, intermediate 1536, 9/3 heads of 64), all four fused
targets, rank 16, 8 adapters, a decode batch of 64 rows (8 per adapter) and a prefill
chunk of 512 rows. Candidates, each against the base projections of the same layer:

    reference   gather each row's A and B, einsum (the spec: kernels/lora_*.py)
    grouped     rows of a batch in arrival order, per adapter: index_select, two
                matmuls, index_add_ (what a batch not ordered by adapter needs)
    runs        the batch ordered by adapter (worker/input_batch.py does so): per run
                of rows, a matmul into the shrink and an in-place addmm per slice,
                float32 slots (as the worker keeps them on a CPU)
    runs_half   (--dtype bfloat16 only) the same with slots in the model's dtype
    slot_batch  (decode rows) each slot's rows padded to one length: per target one
                gather, batched GEMMs, one scatter-add (kernels/lora_slot_batch.py)
    native      (decode rows) the C++ kernel, one call per target
                (kernels/csrc/lora_decode.cpp); *_half: slots in the model's dtype

    .venv/bin/python benchmarks/lora_kernels.py [--threads N] [--iters N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.lora_expand import lora_expand_cpu, lora_expand_reference  # noqa: E402
from kernels.lora_mapping import make_lora_mapping  # noqa: E402
from kernels.lora_shrink import lora_shrink_cpu, lora_shrink_reference  # noqa: E402
from kernels.lora_slot_batch import lora_add_slot_batch  # noqa: E402
from kernels import cpu_extension  # noqa: E402

# target: (in, [slice widths])
TARGETS = {"qkv": (576, [576, 192, 192]), "o": (576, [576]),
           "gate_up": (576, [1536, 1536]), "down": (1536, [576])}


def layer_weights(num_slots, rank, dtype):
    out = {}
    for name, (fan_in, widths) in TARGETS.items():
        a = torch.randn(num_slots, fan_in, len(widths) * rank, dtype=dtype) * 0.05
        b = torch.randn(num_slots, rank, sum(widths), dtype=dtype) * 0.05
        base = torch.randn(fan_in, sum(widths), dtype=dtype) * 0.05  # K-major base weight
        out[name] = (a.transpose(1, 2), b.transpose(1, 2), widths, base)
    return out


def slices(widths, rank):
    offset = 0
    for i, w in enumerate(widths):
        yield i, slice(offset, offset + w), slice(i * rank, (i + 1) * rank)
        offset += w


def run_reference(x_of, y_of, weights, mapping, rank):
    for name, (a, b, widths, _) in weights.items():
        xa = lora_shrink_reference(x_of[name], a, mapping.token_slots)
        for _, cols, ks in slices(widths, rank):
            lora_expand_reference(y_of[name][:, cols], xa[:, ks], b[:, cols], mapping.token_slots)


def run_runs(x_of, y_of, weights, mapping, rank):
    for name, (a, b, widths, _) in weights.items():
        xa = lora_shrink_cpu(x_of[name], a, mapping)
        for _, cols, ks in slices(widths, rank):
            lora_expand_cpu(y_of[name][:, cols], xa[:, ks], b[:, cols], mapping)


def run_grouped(x_of, y_of, weights, groups, rank):
    for name, (a, b, widths, _) in weights.items():
        x, y = x_of[name], y_of[name]
        for slot, rows in groups:
            xa = x.index_select(0, rows).to(a.dtype) @ a[slot].t()
            delta = torch.empty(len(rows), y.shape[1], dtype=a.dtype)
            for _, cols, ks in slices(widths, rank):
                torch.mm(xa[:, ks], b[slot, cols].t(), out=delta[:, cols])
            y.index_add_(0, rows, delta.to(y.dtype))


def run_slot_batch(x_of, y_of, weights, mapping, rank):
    for name, (a, b, widths, _) in weights.items():
        lora_add_slot_batch(y_of[name], x_of[name], a, b, widths, rank, mapping.slot_batch)


def run_native(x_of, y_of, weights, mapping, rank):
    ops = cpu_extension.require()
    for name, (a, b, widths, _) in weights.items():
        ops.lora_decode(y_of[name], x_of[name], a.transpose(1, 2), b.transpose(1, 2),
                        mapping.token_slots, rank, list(widths))


def run_base(x_of, y_of, weights):
    for name, (_, _, _, base) in weights.items():
        torch.mm(x_of[name], base, out=y_of[name])


def timeit(fn, iters):
    fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(num_rows, per_adapter_runs, args, dtype):
    num_slots, rank = args.adapters, args.rank
    weights = layer_weights(num_slots, rank, torch.float32)
    half = layer_weights(num_slots, rank, dtype) if dtype != torch.float32 else None
    x_of = {n: torch.randn(num_rows, fan_in, dtype=dtype) for n, (fan_in, _) in TARGETS.items()}
    y_of = {n: torch.zeros(num_rows, sum(w), dtype=dtype) for n, (_, w) in TARGETS.items()}
    rows_per = num_rows // num_slots
    # runs: the batch ordered by adapter; grouped: round-robin rows, gathered per adapter
    qsl = [i * rows_per // per_adapter_runs for i in range(num_slots * per_adapter_runs + 1)]
    slots = [i // per_adapter_runs for i in range(num_slots * per_adapter_runs)]
    mapping = make_lora_mapping(slots, qsl, torch.device("cpu"))
    groups = [(s, torch.arange(s, num_rows, num_slots)) for s in range(num_slots)]
    base_weights = half or weights
    t = {"base": timeit(lambda: run_base(x_of, y_of, base_weights), args.iters),
         "runs": timeit(lambda: run_runs(x_of, y_of, weights, mapping, rank), args.iters),
         "grouped": timeit(lambda: run_grouped(x_of, y_of, weights, groups, rank), args.iters)}
    if half is not None:
        t["runs_half"] = timeit(lambda: run_runs(x_of, y_of, half, mapping, rank), args.iters)
    if mapping.slot_batch is not None:
        t["slot_batch"] = timeit(lambda: run_slot_batch(x_of, y_of, weights, mapping, rank),
                                 args.iters)
        if cpu_extension.is_available():
            t["native"] = timeit(lambda: run_native(x_of, y_of, weights, mapping, rank),
                                 args.iters)
            if half is not None:
                t["native_half"] = timeit(
                    lambda: run_native(x_of, y_of, half, mapping, rank), args.iters)
    if num_rows <= 64:
        t["reference"] = timeit(lambda: run_reference(x_of, y_of, weights, mapping, rank),
                                max(3, args.iters // 4))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"one layer, {args.adapters} adapters of rank {args.rank}, {args.dtype}, "
          f"{torch.get_num_threads()} threads; ms per layer (median)")
    for rows, runs_per_adapter in ((32, 1), (64, 1), (64, 8), (512, 1)):
        t = measure(rows, runs_per_adapter, args, dtype)
        extra = "  ".join(f"{k} {v * 1e3:7.3f} (+{v / t['base'] * 100:5.1f}%)"
                          for k, v in t.items() if k != "base")
        print(f"{rows:4d} rows in {runs_per_adapter} run(s) per adapter: base {t['base'] * 1e3:7.3f}  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
