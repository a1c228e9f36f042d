"""Decode steps against two limits, same run: the linear-layer roofline at batch B, and
at batch 1 the memory-bandwidth limit for the bytes a step reads.

* Linear-layer roofline at batch B: the time the model's linear layers alone take on B
  rows (q/k/v, o, gate/up and down in every layer, plus the LM head), each through the
  path Folio chose for it (worker/linear_backend.py) and, for weights held as tensors,
  plain ``F.linear`` too; the faster counts. ``B / linear_seconds`` is the most tokens
  per second a step could produce.
* Bandwidth limit at batch 1: a step must read every weight once (quantized weights at
  their packed size), the LM head included, plus the request's K/V for attention. With
  the read bandwidth measured in the same run (``benchmarks/machine.py``), right before
  each round's steps, ``bytes / bandwidth`` is the fastest a step can be.

Each batch size runs ``--rounds`` rounds, each measuring its limit and its steps back
to back; the median round is reported (a shared VM drifts within one run).

The decode side runs the real engine: B requests with ``--context`` prompt tokens are
prefilled, then only steps where all B requests decode one token are timed (the whole
``EngineCore.step()``: scheduling, batch building, forward, sampling, bookkeeping),
``--steps`` of them after ``--warmup-steps`` (the first steps after a prefill run
slower); at batch 1 the K/V bytes are counted at the timed steps' mean context.
``--serve`` adds a single stream through ``folio serve`` (one client, TPOT), and
``--llama-bench`` llama.cpp's ``llama-bench`` tg128 on the same GGUF and threads
(benchmarks/llamacpp.py builds it); ``--pairs N`` alternates the two N times in one
sitting and reports each pair's ratio (a shared VM drifts by more than their gap), with
``--serve`` also for the served stream.

    .venv/bin/python benchmarks/decode_roofline.py --batch-sizes 1 32 64 --serve --llama-bench
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

from benchmarks.machine import machine_facts, memory_bandwidth_gb_s  # noqa: E402


def linear_layers(model):
    """(weight, bias, choice) of every matmul a decode step runs, in model order, each
    once (an untied LM head is both a Linear module and the head)."""
    from worker.linear_backend import linear_weights
    seen, layers = set(), []
    for owner, attr, weight in linear_weights(model):
        if id(weight) not in seen:
            seen.add(id(weight))
            layers.append((weight, getattr(owner, "bias", None) if attr == "choice" else None,
                           getattr(owner, attr)))
    return layers


def weight_bytes(weight) -> int:
    return weight.nbytes if not isinstance(weight, torch.Tensor) else (
        weight.numel() * weight.element_size())


def decode_step_bytes(runner, context: int) -> dict:
    """What a batch-1 decode step must read: every linear weight once, one request's
    K/V over ``context`` tokens in every layer (norms and one embedding row are noise)."""
    weights = sum(weight_bytes(w) for w, _, _ in linear_layers(runner.model))
    arch = runner.arch
    kv = (2 * arch.num_hidden_layers * context * arch.num_key_value_heads * arch.head_dim
          * torch.empty((), dtype=runner.dtype).element_size())
    return {"weights": weights, "kv": kv, "total": weights + kv}


@torch.inference_mode()
def time_linears(layers, batch, dtype, plain: bool, repeats):
    """Best-of-``repeats`` seconds for one pass over all layers at ``batch`` rows,
    through each layer's chosen path, or plain ``F.linear`` (None if a weight is not a
    tensor)."""
    from worker.models.linear import linear
    if plain and not all(isinstance(w, torch.Tensor) for w, _, _ in layers):
        return None
    xs = {w.shape[1]: torch.randn(batch, w.shape[1]).to(dtype) for w, _, _ in layers}
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for w, b, choice in layers:
            if plain:
                F.linear(xs[w.shape[1]], w, b)
            else:
                linear(xs[w.shape[1]], w, b, choice)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def time_decode_steps(llm, batch, context, steps, warmup=0):
    """Seconds of each engine step in which exactly ``batch`` requests decode (a run of
    k decode steps, scheduler.num_scheduler_steps, counts as k steps of its mean time):
    ``steps`` of them after the first ``warmup``. The first decode steps after a
    prefill run slower: on the AMX Xeon every part of the step (layers, LM head, batch
    building) took 1.3-1.5x its later time for the first 8-12 tokens, with or without
    AMX in the prefill, then settled."""
    from engine_core.outputs import ModelRunnerOutput
    from folio import SamplingParams
    engine = llm.engine
    prefill_steps = -(-batch * context // llm.config.scheduler.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + prefill_steps + 1,
                            ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (i * 7919 + j * 31) % 40000 for j in range(context)]
        engine.add_request(f"roof-{batch}-{i}-{time.monotonic_ns()}", prompt, params)
    decode_times = []
    while engine.has_unfinished_requests():
        so = engine.begin_step()
        t0 = time.perf_counter()
        out = engine.executor.execute_model(so) if engine.needs_worker(so) else None
        engine.end_step(so, out or ModelRunnerOutput())
        elapsed = time.perf_counter() - t0
        k = so.num_decode_steps
        if (len(so.num_scheduled_tokens) == batch
                and so.total_num_scheduled_tokens == batch * k):
            decode_times.extend([elapsed / k] * k)
    return decode_times[warmup:warmup + steps]


def roofline_round(llm, layers, batch, args) -> dict:
    """The linears' roofline and the decode step at ``batch``, back to back."""
    dtype = llm.runner.dtype
    chosen = time_linears(layers, batch, dtype, False, args.repeats)
    plain = time_linears(layers, batch, dtype, True, args.repeats)
    roofline = min(t for t in (chosen, plain) if t is not None)
    # batch 1 is also held against the bandwidth limit: read bandwidth beside its steps
    bandwidth = memory_bandwidth_gb_s() if batch == 1 else None
    steps = time_decode_steps(llm, batch, args.context, args.steps, args.warmup_steps)
    step = statistics.median(steps)
    return {"bandwidth_gb_s": bandwidth, "linear_seconds_folio": chosen,
            "linear_seconds_torch": plain, "linear_seconds": roofline,
            "decode_step_seconds": step,
            "decode_step_seconds_all": steps, "fraction_of_roofline": roofline / step}


def median_round(rounds: list[dict], key: str) -> dict:
    """The round whose ``key`` is the median (the lower one of an even count)."""
    return sorted(rounds, key=lambda r: r[key])[(len(rounds) - 1) // 2]


def roofline_row(llm, layers, batch, args) -> dict:
    """``args.rounds`` rounds of (linears, steps), each pair measured back to back: a
    shared VM's speed drifts within a run (the same linears took 29-93 ms at batch 64
    on the EPYC within minutes), so a roofline timed once, before all the steps, can
    be measured on another machine state than the steps it is compared with. The row's
    fraction is the median of the rounds' fractions; its times are that round's."""
    rounds = [roofline_round(llm, layers, batch, args) for _ in range(args.rounds)]
    mid = median_round(rounds, "fraction_of_roofline")
    roofline, step = mid["linear_seconds"], mid["decode_step_seconds"]
    row = {"batch": batch, **mid, "roofline_tok_s": batch / roofline,
           "decode_tok_s": batch / step, "warmup_steps": args.warmup_steps,
           "rounds": rounds}
    spread = " ".join(f"{100 * r['fraction_of_roofline']:.1f}" for r in rounds)
    print(f"batch {batch:4d}: linears {roofline * 1e3:7.2f} ms -> roofline "
          f"{batch / roofline:7.1f} tok/s | decode step {step * 1e3:7.2f} ms -> "
          f"{batch / step:7.1f} tok/s | {100 * roofline / step:5.1f}% of roofline"
          + (f" (median of rounds: {spread})" if len(rounds) > 1 else ""), flush=True)
    return row


def bandwidth_row(runner, step_seconds: float, bandwidth: float, context: int) -> dict:
    """``context``: the timed steps' mean context (K/V grows by a token a step)."""
    read = decode_step_bytes(runner, context)
    limit = read["total"] / (bandwidth * 1e9)
    print(f"batch 1 reads {read['total'] / 1e6:.1f} MB ({read['weights'] / 1e6:.1f} MB "
          f"weights); at {bandwidth:.1f} GB/s the limit is {limit * 1e3:.2f} ms "
          f"({1 / limit:.1f} tok/s); the step takes {step_seconds * 1e3:.2f} ms: "
          f"{100 * limit / step_seconds:.1f}% of the bandwidth limit", flush=True)
    return {"bytes": read, "bandwidth_gb_s": bandwidth, "limit_seconds": limit,
            "limit_tok_s": 1 / limit, "step_seconds": step_seconds,
            "fraction_of_bandwidth_limit": limit / step_seconds}


def _status_bytes(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def memory_row(runner, model_file: Path) -> dict:
    """This process's resident memory against the issue's bound: the model file's size
    plus the KV pool plus 300 MB. The process is the whole in-process engine (worker,
    engine core, tokenizer, torch itself), so it overstates the worker alone."""
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    files = [model_file] if model_file.is_file() else list(model_file.glob("*.safetensors"))
    file_bytes = sum(f.stat().st_size for f in files)
    bound = file_bytes + kv + 300 * 2 ** 20
    row = {"rss_bytes": _status_bytes("VmRSS"), "peak_rss_bytes": _status_bytes("VmHWM"),
           "model_file_bytes": file_bytes, "kv_pool_bytes": kv, "bound_bytes": bound}
    print(f"RSS {row['rss_bytes'] / 2 ** 20:.0f} MiB (peak {row['peak_rss_bytes'] / 2 ** 20:.0f})"
          f" vs model file {file_bytes / 2 ** 20:.0f} MiB + KV pool {kv / 2 ** 20:.0f} MiB + "
          f"300 MiB = {bound / 2 ** 20:.0f} MiB", flush=True)
    return row


def serve_single_stream(args) -> dict:
    """One client through `folio serve`: decode tok/s as 1 / mean TPOT."""
    from benchmarks.serve_stack import served_model, serving
    from folio.bench.serve import LoadSpec, bench_serve
    from model_files.paths import resolve_model_path
    from folio.bench.workload import make_workload
    from text.tokenizer import Tokenizer
    kv_bytes = int(args.kv_cache_gib * 1024 ** 3)
    settings = {"model": {"path": args.model, "dtype": args.dtype, "max_model_len": 2048,
                          "quantization": args.quantization},
                "memory": {"kv_cache_bytes": kv_bytes},
                "worker": {"num_threads": args.threads, "linear_backend": args.linear_backend},
                "observability": {"log_level": "warning"}}
    if args.scheduler_steps is not None:
        settings["scheduler"] = {"num_scheduler_steps": args.scheduler_steps}
    reqs = make_workload(Tokenizer.from_model_path(args.model), "fixed", 4, args.context,
                         128, seed=1)
    pairs = None
    with serving(settings) as (url, pid):
        model = served_model(url)
        bench_serve(url, model, reqs[:1], LoadSpec(max_concurrency=1))  # warm-up
        report = bench_serve(url, model, reqs, LoadSpec(max_concurrency=1))
        memory = worker_memory(pid, Path(resolve_model_path(args.model)), kv_bytes)
        if args.pairs:  # the stack idles while llama-bench runs
            pairs = alternated_pairs(
                lambda: 1000 / bench_serve(url, model, reqs,
                                           LoadSpec(max_concurrency=1))["tpot_ms"]["mean"],
                Path(resolve_model_path(args.model)), args, "folio_serve_tok_s")
    tok_s = 1000 / report["tpot_ms"]["mean"]
    print(f"folio serve, 1 client: TPOT {report['tpot_ms']['mean']:.2f} ms -> "
          f"{tok_s:.1f} tok/s", flush=True)
    out = {"tpot_ms": report["tpot_ms"], "tok_s": tok_s, "failed": report["failed"],
           "worker_memory": memory}
    if pairs:
        out["pairs"] = pairs
    return out


def worker_memory(serve_pid: int, model_file: Path, kv_bytes: int) -> dict:
    """The worker process's resident memory against the issue's bound: the model file's
    size plus the KV pool plus 300 MB; right after the last request, and at rest (once
    the idle worker has trimmed its heap, services/worker_service/service.py)."""
    from observability.process_stats import command_line, descendants
    from services.worker_service.service import IDLE_TRIM_SECONDS
    worker = next(p for p in descendants(serve_pid)
                  if "services.worker_service" in " ".join(command_line(p)))
    rss, peak = (_status_bytes(field, worker) for field in ("VmRSS", "VmHWM"))
    time.sleep(IDLE_TRIM_SECONDS + 1.0)
    rest = _status_bytes("VmRSS", worker)
    files = [model_file] if model_file.is_file() else list(model_file.glob("*.safetensors"))
    bound = sum(f.stat().st_size for f in files) + kv_bytes + 300 * 2 ** 20
    print(f"worker RSS {rss / 2 ** 20:.0f} MiB after the last request, {rest / 2 ** 20:.0f} "
          f"at rest (peak {peak / 2 ** 20:.0f}) vs bound {bound / 2 ** 20:.0f} MiB", flush=True)
    return {"rss_bytes": rss, "rest_rss_bytes": rest, "peak_rss_bytes": peak,
            "kv_pool_bytes": kv_bytes, "bound_bytes": bound, "within_bound": rss <= bound,
            "within_bound_at_rest": rest <= bound}


def alternated_pairs(measure, gguf: Path, args, key: str = "folio_tok_s") -> dict:
    """``measure()`` (Folio's tok/s) and ``llama-bench`` tg128 alternated ``args.pairs``
    times in one sitting: on a shared VM the machine's speed drifts by more than the gap
    between the two, so each ratio compares neighbours in time (Folio idles while
    llama-bench runs). Rows hold Folio's tok/s under ``key``."""
    from benchmarks.llamacpp import llama_bench
    rows = []
    for i in range(args.pairs):
        folio = measure()
        bench = llama_bench(gguf, args.threads, repetitions=2)
        rows.append({key: folio, "llama_bench_tok_s": bench["tok_s"],
                     "ratio": folio / bench["tok_s"]})
        print(f"pair {i + 1}: {key} {folio:.1f}, llama-bench {bench['tok_s']:.1f} tok/s: "
              f"{rows[-1]['ratio']:.2f}x", flush=True)
    ratio = statistics.median(r["ratio"] for r in rows)
    print(f"{key} alternated with llama-bench, median ratio {ratio:.2f}x "
          f"({min(r['ratio'] for r in rows):.2f}-{max(r['ratio'] for r in rows):.2f}x)")
    return {"rows": rows, "median_ratio": ratio}


def run(args) -> dict:
    from folio import LLM
    from model_files.paths import resolve_model_path
    torch.set_num_threads(args.threads)
    result = {"machine_at_start": machine_facts(), "context": args.context}
    bandwidth = memory_bandwidth_gb_s()
    result["bandwidth_at_start_gb_s"] = bandwidth
    print(f"read bandwidth {bandwidth:.1f} GB/s ({args.threads} threads)", flush=True)
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              num_threads=args.threads, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=2048,
              max_model_len=args.context + args.warmup_steps + args.steps + 64,
              enable_prefix_caching=False, kv_cache_bytes=int(args.kv_cache_gib * 1024 ** 3),
              **{"observability.log_level": "warning",
                 "worker.linear_backend": args.linear_backend,
                 "memory.kv_cache_dtype": args.kv_cache_dtype})
    runner = llm.runner
    layers = linear_layers(runner.model)
    result.update(dtype=str(runner.dtype), quantization=runner.quantization,
                  kv_cache_dtype=args.kv_cache_dtype,
                  linear_backend=args.linear_backend,
                  fused_decode=runner.model.fused_decode is not None,
                  linear_table=runner.linear_table, threads=torch.get_num_threads())
    result["rows"] = [roofline_row(llm, layers, b, args) for b in args.batch_sizes]
    one = [r for r in result["rows"] if r["batch"] == 1]
    if one:
        context = args.context + args.warmup_steps + args.steps // 2  # the timed steps' mean
        rounds = [bandwidth_row(runner, r["decode_step_seconds"], r["bandwidth_gb_s"], context)
                  for r in one[0]["rounds"]]
        result["batch_1"] = dict(median_round(rounds, "fraction_of_bandwidth_limit"))
        result["batch_1"]["rounds"] = rounds
        if len(rounds) > 1:
            print("batch 1, median round: "
                  f"{100 * result['batch_1']['fraction_of_bandwidth_limit']:.1f}% of the "
                  "bandwidth limit", flush=True)
        result["batch_1"]["context"] = context
        result["bandwidth_after_gb_s"] = memory_bandwidth_gb_s()
    result["memory"] = memory_row(runner, Path(resolve_model_path(args.model)))
    if args.pairs:
        result["pairs"] = alternated_pairs(
            lambda: 1 / statistics.median(time_decode_steps(llm, 1, args.context, args.steps,
                                                            args.warmup_steps)),
            Path(resolve_model_path(args.model)), args)
    del llm, runner
    if args.serve:
        result["serve_single_stream"] = serve_single_stream(args)
    if args.llama_bench:
        from benchmarks.llamacpp import llama_bench
        bench = llama_bench(resolve_model_path(args.model), args.threads)
        result["llama_bench"] = bench
        print(f"llama-bench {bench['test']}, {args.threads} threads: {bench['tok_s']:.1f} "
              f"+- {bench['tok_s_sd']:.1f} tok/s", flush=True)
        folio_tok_s = one[0]["decode_tok_s"] if one else None
        if folio_tok_s:
            result["in_process_vs_llama_bench"] = folio_tok_s / bench["tok_s"]
            print(f"Folio in-process / llama-bench: {folio_tok_s / bench['tok_s']:.2f}x")
        if args.serve:
            ratio = result["serve_single_stream"]["tok_s"] / bench["tok_s"]
            result["serve_vs_llama_bench"] = ratio
            print(f"Folio serve / llama-bench: {ratio:.2f}x")
    result["machine_at_end"] = machine_facts()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--linear-backend", default="auto",
                    help="worker.linear_backend (int8: the quantized kernels' integer route)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per batch")
    ap.add_argument("--warmup-steps", type=int, default=16,
                    help="decode steps after the prefill left out of the timing (they run "
                         "slower: time_decode_steps)")
    ap.add_argument("--repeats", type=int, default=3, help="linear-layer passes (best)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of (linears, decode steps) per batch size; the median "
                         "round's fraction is reported")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="memory.kv_cache_dtype: auto (the model's) | fp8 | int8 | ...")
    ap.add_argument("--serve", action="store_true", help="single stream via folio serve")
    ap.add_argument("--llama-bench", action="store_true",
                    help="llama.cpp llama-bench tg128, same GGUF and threads")
    ap.add_argument("--pairs", type=int, default=0,
                    help="alternate Folio's batch-1 decode (and with --serve the served "
                         "stream) and llama-bench this many times (a GGUF model)")
    ap.add_argument("--scheduler-steps", type=int, default=None,
                    help="scheduler.num_scheduler_steps of the served stack (default: "
                         "the YAML's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
