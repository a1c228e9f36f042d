"""Decode attention: the torch reference (gather + SDPA) against the native CPU kernel.

Shapes of the default model (SmolLM2-135M: 9 query heads, 3 kv heads, head_dim 64,
30 layers), block size 16 (``--block-size``), every request a decode with a context
drawn uniformly from ±20 % of the nominal length (``--shapes`` batch:context pairs),
blocks scattered over a shuffled cache. Each timed call uses a different "layer"
cache, rotating over enough of them (up to 30) that the keys and values do not sit in
the last-level cache, as in a real forward pass. Reported: the CPU model and flags,
milliseconds per layer call (median over rounds) and the step-level plan cost of the
reference (make_plan, paid once per step, not per layer).

    .venv/bin/python benchmarks/decode_attention.py              # fp32, 2 threads
    .venv/bin/python benchmarks/decode_attention.py --dtype bfloat16 --build-times
    .venv/bin/python benchmarks/decode_attention.py --dtype bfloat16 --shapes 1:170 64:170 \
        --block-size 128

With ``--base DIR`` (another checkout, in its own folder) only the kernel is timed, in a
process per checkout (the extension is built per source folder), base then this one,
alternated ``--pairs`` times, and the ratio base / this is printed per shape. ``--hot``
keeps one layer's cache, so the keys and values stay in the caches: the kernel's
arithmetic, not the memory, is timed.

    git worktree add /tmp/base <rev>
    .venv/bin/python benchmarks/decode_attention.py --dtype bfloat16 --base /tmp/base --hot \
        --threads 1 --shapes 1:128 1:2048 64:170 --v-pass paired
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model_and_flags  # noqa: E402

HERE = Path(__file__).resolve().parents[1]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30
LLC_BYTES = 33 << 20


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into memory advised for 2 MB pages (worker/huge_pages.py)."""
    from worker.huge_pages import huge_page_buffer
    buf = huge_page_buffer(t.numel() * t.element_size())
    if buf is None:
        return t
    out = buf.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def make_batch(batch, context, dtype, seed=0, block_size=BLOCK_SIZE, huge_pages=False):
    rng = random.Random(seed)
    seq_lens = [rng.randint(int(context * 0.8), int(context * 1.2)) for _ in range(batch)]
    nblocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nblocks) + 1
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    tables = torch.zeros(batch, max(nblocks), dtype=torch.int64)
    used = 0
    for r, n in enumerate(nblocks):
        tables[r, :n] = perm[used:used + n]
        used += n
    shape = (2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    layer_bytes = torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
    num_caches = max(2, min(NUM_LAYERS, -(-4 * LLC_BYTES // layer_bytes)))
    caches = [torch.randn(shape, dtype=dtype) for _ in range(num_caches)]
    if huge_pages:
        caches = [on_huge_pages(c) for c in caches]
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype)
    return query, caches, tables, torch.tensor(seq_lens, dtype=torch.int64)


def time_per_call(fn, caches, rounds):
    fn(caches[0])  # warm-up
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for cache in caches:
            fn(cache)
        per_call.append((time.perf_counter() - t0) / len(caches))
    return statistics.median(per_call) * 1e3


def kernel_ms(batch, context, dtype, rounds, block_size=BLOCK_SIZE, huge_pages=False,
              hot=False, v_pass=None):
    """Milliseconds per layer call of the kernel alone (``hot``: one layer's cache;
    ``v_pass``: the kernel's V pass, None for its default)."""
    from kernels import cpu_paged_attention as cpa
    query, caches, tables, lens = make_batch(batch, context, dtype, block_size=block_size,
                                             huge_pages=huge_pages)
    caches = caches[:1] if hot else caches
    extra = {} if v_pass is None else {"v_pass": v_pass}
    return time_per_call(lambda cache: cpa.paged_attention_decode(
        query, cache, tables, lens, HEAD_DIM ** -0.5, **extra), caches * (30 if hot else 1),
        rounds)


def bench(batch, context, dtype, rounds, block_size=BLOCK_SIZE, huge_pages=False,
          v_pass="widened"):
    from kernels import cpu_paged_attention as cpa
    from kernels.paged_attention import make_plan, paged_attention_reference
    query, caches, tables, lens = make_batch(batch, context, dtype, block_size=block_size,
                                             huge_pages=huge_pages)
    scale = HEAD_DIM ** -0.5
    t0 = time.perf_counter()
    plan = make_plan(list(range(batch + 1)), lens.tolist(), tables, block_size)
    plan_ms = (time.perf_counter() - t0) * 1e3
    kv = torch.zeros(batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)

    def ref(cache):
        return paged_attention_reference(query, kv, kv, cache, plan, scale)

    def kernel(cache):
        return cpa.paged_attention_decode(query, cache, tables, lens, scale, v_pass=v_pass)

    err = (ref(caches[0]).float() - kernel(caches[0]).float()).abs().max().item()
    ref_ms = time_per_call(ref, caches, rounds)
    ker_ms = time_per_call(kernel, caches, rounds)
    kv_mb = 2 * int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * query.element_size() / 2**20
    return dict(batch=batch, context=context, kv_mb=kv_mb, plan_ms=plan_ms, ref_ms=ref_ms,
                kernel_ms=ker_ms, speedup=ref_ms / ker_ms, max_err=err,
                kernel_gbs=kv_mb / 1024 / (ker_ms / 1e3))


_LOAD_SNIPPET = ("import time; t=time.perf_counter(); "
                 "from kernels import cpu_paged_attention as c; ok=c.is_available(); "
                 "print(ok, c.load_seconds, c.unavailable_reason())")


def build_times():
    """Cold build and warm load of the extension, each in a fresh interpreter."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, FOLIO_CACHE_DIR=tmp)
        times = {}
        for label in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET], cwd=root, env=env,
                                 capture_output=True, text=True, check=True).stdout.split()
            assert out[0] == "True", out
            times[label] = float(out[1])
    return times


def child(args, shapes) -> None:
    """Runs inside one checkout (cwd): prints the kernel's ms per shape as JSON."""
    sys.path.insert(0, str(Path.cwd()))
    from kernels import cpu_paged_attention as cpa
    assert cpa.is_available(), cpa.unavailable_reason()
    dtype = getattr(torch, args.dtype)
    out = {f"{b}:{c}": kernel_ms(b, c, dtype, args.rounds, args.block_size, args.huge_pages,
                                 args.hot, args.v_pass) for b, c in shapes}
    print("RESULT " + json.dumps(out))


def run_checkout(root: Path, args, v_pass=None) -> dict[str, float]:
    cmd = [sys.executable, str(HERE / "benchmarks" / "decode_attention.py"), "--child",
           "--dtype", args.dtype, "--threads", str(args.threads), "--rounds", str(args.rounds),
           "--block-size", str(args.block_size), "--shapes", *args.shapes,
           *(["--huge-pages"] if args.huge_pages else []), *(["--hot"] if args.hot else []),
           *(["--v-pass", v_pass] if v_pass else [])]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{root}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def against_base(args) -> None:
    """The kernel of ``args.base`` and of this checkout, alternated, per shape."""
    pairs = []
    for p in range(args.pairs):
        base = run_checkout(args.base.resolve(), args)  # its default V pass
        this = run_checkout(HERE, args, args.v_pass)
        pairs.append({"base_ms": base, "this_ms": this})
        for shape in args.shapes:
            print(f"pair {p + 1} {shape:>9}: base {base[shape]:8.4f} ms, this "
                  f"{this[shape]:8.4f} ms, base / this {base[shape] / this[shape]:.2f}x",
                  flush=True)
    for shape in args.shapes:
        ratios = [q["base_ms"][shape] / q["this_ms"][shape] for q in pairs]
        print(f"{shape:>9}: base / this median {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        from benchmarks.machine import machine_facts
        args.json.write_text(json.dumps({"machine": machine_facts(),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "pairs": pairs}, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32",
                    choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                    help="tokens per KV block (memory.block_size)")
    ap.add_argument("--shapes", nargs="+", default=["32:300", "32:700", "128:300", "128:700"],
                    help="batch:context pairs")
    ap.add_argument("--huge-pages", action="store_true",
                    help="the caches on 2 MB pages, as worker.huge_pages puts the KV pool")
    ap.add_argument("--build-times", action="store_true",
                    help="also time a cold build and a warm load in subprocesses")
    ap.add_argument("--hot", action="store_true",
                    help="with --base: one layer's cache, its keys and values kept in cache")
    ap.add_argument("--base", type=Path,
                    help="another checkout: time its kernel and this one's, alternated")
    ap.add_argument("--pairs", type=int, default=3, help="with --base: alternations")
    ap.add_argument("--json", type=Path, help="with --base: write the pairs here")
    ap.add_argument("--v-pass", choices=["widened", "paired"],
                    help="this checkout's V pass (bf16; worker.decode_v_pass in the "
                         "engine); with --base the base takes its default")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in shape.split(":")) for shape in args.shapes]
    if args.child:
        return child(args, shapes)
    model, flags = cpu_model_and_flags()
    if args.base is not None:
        print(f"{model}; {' '.join(flags)}")
        print(f"decode attention kernel, {args.dtype}, {args.threads} threads, "
              f"{'hot' if args.hot else 'cold'} caches, this checkout's V pass "
              f"{args.v_pass or 'default'}; ms per layer call")
        return against_base(args)
    from kernels import cpu_paged_attention as cpa
    if args.build_times:
        t = build_times()
        print(f"extension build: cold {t['cold']:.1f} s, warm load {t['warm']:.2f} s")
    assert cpa.is_available(), cpa.unavailable_reason()
    dtype = getattr(torch, args.dtype)
    print(f"{model}; {' '.join(flags)}")
    print(f"decode attention, {args.dtype}, {args.threads} threads, H={NUM_HEADS} "
          f"kvH={NUM_KV_HEADS} hd={HEAD_DIM} block={args.block_size}"
          f"{', 2 MB pages' if args.huge_pages else ''}, V pass {args.v_pass or 'widened'}; "
          "ms per layer call")
    print(f"{'batch':>5} {'ctx':>4} {'KV MB':>7} {'reference':>10} {'kernel':>8} "
          f"{'speedup':>7} {'kernel GB/s':>11} {'x30 layers ref/kernel':>22} "
          f"{'plan/step':>9} {'max err':>8}")
    for batch, context in shapes:
        r = bench(batch, context, dtype, args.rounds, args.block_size, args.huge_pages,
                  args.v_pass or "widened")
        print(f"{r['batch']:>5} {r['context']:>4} {r['kv_mb']:>7.1f} "
              f"{r['ref_ms']:>10.2f} {r['kernel_ms']:>8.2f} {r['speedup']:>6.1f}x "
              f"{r['kernel_gbs']:>11.1f} "
              f"{r['ref_ms'] * NUM_LAYERS:>11.0f} / {r['kernel_ms'] * NUM_LAYERS:<8.0f}"
              f" {r['plan_ms']:>9.2f} {r['max_err']:>8.1e}")


if __name__ == "__main__":
    main()
