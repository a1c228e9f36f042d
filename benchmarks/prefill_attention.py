"""Prompt attention: Folio's kernel (worker.prefill_attention: native; AMX tiles, or
AVX512-BF16 dot products without AMX) against torch SDPA.

The default model's shape (9 query heads, 3 kv heads, head_dim 64; ``--heads``,
``--kv-heads``, ``--head-dim`` for another model's), bf16, 8 prompts of
each length in one step, q/k/v sliced out of one fused projection as the model does.
SDPA runs per prompt, as the sdpa path does. Prints microseconds per prompt and the
ratio, and each side's agreement with float32 attention on the same bf16 inputs (the
share of outputs equal to float32 rounded to bf16, and the mean absolute error).

    .venv/bin/python benchmarks/prefill_attention.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_facts  # noqa: E402
from kernels import cpu_paged_attention as native  # noqa: E402


def step(lens, heads, kv_heads, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int64)
    return q, k, v, starts, torch.tensor(lens, dtype=torch.int64)


def sdpa(q, k, v, starts, lens, scale, out, dtype=None):
    for s, n in zip(starts.tolist(), lens.tolist()):
        args = [t[s:s + n].transpose(0, 1)[None] for t in (q, k, v)]
        if dtype is not None:
            args = [a.to(dtype) for a in args]
        out[s:s + n] = F.scaled_dot_product_attention(
            *args, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out


def timed(fn, repeat):
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 100, 200, 384])
    ap.add_argument("--prompts", type=int, default=8, help="prompts of each length per step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not native.prefill_attention_available():
        sys.exit("the prefill kernel does not run here (needs AVX512-BF16)")
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    kernel = "AMX tiles" if native.prefill_attention_on_tiles() else "AVX512-BF16 dot products"
    print(f"kernel: {kernel}", flush=True)
    scale = head_dim ** -0.5
    rows = []
    for n in args.lengths:
        q, k, v, starts, lens = step([n] * args.prompts, heads, kv_heads, head_dim, seed=n)
        out_native, out_sdpa = torch.empty_like(q), torch.empty_like(q)
        t_native = timed(lambda: native.prefill_attention(
            q, k, v, starts, lens, scale, out_native), args.repeat) / args.prompts
        t_sdpa = timed(lambda: sdpa(q, k, v, starts, lens, scale, out_sdpa),
                       args.repeat) / args.prompts
        exact = sdpa(q, k, v, starts, lens, scale, torch.empty(q.shape), torch.float32)
        rounded = exact.to(torch.bfloat16)
        row = {"length": n, "native_us": round(t_native * 1e6, 1),
               "sdpa_us": round(t_sdpa * 1e6, 1), "speedup": round(t_sdpa / t_native, 2)}
        for name, out in (("native", out_native), ("sdpa", out_sdpa)):
            equal = (out == rounded).float().mean().item()
            error = (out.float() - exact).abs().mean().item()
            row[f"{name}_equal_to_float32_rounded"] = round(equal, 4)
            row[f"{name}_mean_abs_error"] = float(f"{error:.3e}")
        rows.append(row)
        print(f"{n:5d} tokens: native {row['native_us']:8.1f} us  "
              f"sdpa {row['sdpa_us']:8.1f} us  "
              f"{row['speedup']:.2f}x   outputs = float32 rounded: native "
              f"{row['native_equal_to_float32_rounded']:.3f}, sdpa "
              f"{row['sdpa_equal_to_float32_rounded']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": {"heads": heads, "kv_heads": kv_heads,
                                                         "head_dim": head_dim},
                                               "kernel": kernel,
                                               "prompts_per_step": args.prompts,
                                               "threads": args.threads, "rows": rows,
                                               "machine": machine_facts()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
