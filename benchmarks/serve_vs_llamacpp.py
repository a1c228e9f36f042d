"""Serving side by side: `folio serve` and llama.cpp's own `llama-server` (continuous
batching, ``-np N -cb``) on the same GGUF file (SmolLM2-135M-Instruct Q4_1), same
machine, same client (`folio bench serve`'s), in one run: aggregate throughput and
latency at fixed concurrency, and single-stream decode speed. The CPU model, its vector
flags and the load average are recorded with the result.

Precision: llama.cpp computes on the file's blocks; Folio too with ``--quantization
auto`` (the default: the GGUF stays quantized), or on dequantised floats with ``none``.
``--linear-backend int8`` quantizes Folio's activations per block of 32 for the
products (llama.cpp multiplies Q4_1 by Q8_1 activations the same way); the default
(``auto``) keeps them in float. The report says which. Both are told to ignore EOS
(``ignore_eos`` and a -100 logit bias on the end tokens) so both generate exactly the
requested lengths.

The native binaries come from benchmarks/llamacpp.py (built from the llama-cpp-python
sdist's vendored source into the git-ignored ``.llamacpp/``; ``--build-llamacpp`` builds
them first, 5-15 minutes on 2 cores). ``--llamacpp python`` runs llama-cpp-python's
one-request-at-a-time server instead (``--install-llamacpp`` puts it in its own venv):

    .venv/bin/python benchmarks/serve_vs_llamacpp.py --build-llamacpp \
        --json benchmarks/results/serve_vs_llamacpp.json
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import llamacpp  # noqa: E402
from benchmarks.machine import machine_facts  # noqa: E402
from benchmarks.serve_stack import serving  # noqa: E402
from folio.bench.serve import LoadSpec, bench_serve, format_report  # noqa: E402
from folio.bench.workload import make_workload  # noqa: E402
from text.tokenizer import Tokenizer  # noqa: E402
from worker.device import resolve_dtype  # noqa: E402
from model_files.paths import default_model_path  # noqa: E402

LLAMACPP_VENV = REPO / ".venv-llamacpp"
LLAMACPP_PACKAGE = "llama-cpp-python[server]==0.3.36"
MODEL = "SmolLM2-135M-Instruct"


def install_llamacpp() -> None:
    if not (LLAMACPP_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(LLAMACPP_VENV)], check=True)
    subprocess.run([str(LLAMACPP_VENV / "bin" / "pip"), "install", "-q", LLAMACPP_PACKAGE],
                   check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, what: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)  # llama-server: 503 while loading
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.5)


class LlamaCppServer:
    """A llama.cpp server on the default GGUF: native ``llama-server`` with ``slots``
    parallel sequences batched continuously, each with ``slot_ctx`` tokens of context,
    or (``python``) llama_cpp.server, context 2048, one request at a time."""

    def __init__(self, kind: str, threads: int, slots: int, slot_ctx: int):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if kind == "native":
            exe = llamacpp.binary("llama-server")
            if exe is None:
                raise SystemExit("llama-server is not built; rerun with --build-llamacpp")
            cmd = [str(exe), "-m", str(default_model_path()), "--alias", MODEL,
                   "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                   "-tb", str(threads), "-np", str(slots), "-cb",
                   "-c", str(slots * slot_ctx)]
            ready = self.url + "/health"
        else:
            cmd = [str(LLAMACPP_VENV / "bin" / "python"), "-m", "llama_cpp.server",
                   "--model", str(default_model_path()), "--model_alias", MODEL,
                   "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", "2048",
                   "--n_threads", str(threads), "--n_threads_batch", str(threads),
                   "--interrupt_requests", "False"]  # queue concurrent requests
            ready = self.url + "/v1/models"
        self.command = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_ready(self.proc, ready, cmd[0])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_both(runs: dict, args) -> dict:
    tokenizer = Tokenizer.from_model_path("default")
    eos_bias = {"logit_bias": {str(t): -100 for t in tokenizer.eos_token_ids}}
    results, command = {}, None
    folio_settings = {"model": {"max_model_len": 2048, "dtype": args.dtype,
                                "quantization": args.quantization},
                      "worker": {"num_threads": args.threads,
                                 "linear_backend": args.linear_backend},
                      "observability": {"log_level": "warning"}}
    servers = (("folio", None), ("llama.cpp", eos_bias))
    for server, extra in servers:
        if server == "folio":
            ctx = serving(folio_settings)
            url, _ = ctx.__enter__()
        else:
            llama = LlamaCppServer(args.llamacpp, args.threads, args.concurrency,
                                   args.input_len + args.output_len + 64)
            url = llama.url
            command = llama.command
        try:
            for run, (concurrency, num_prompts) in runs.items():
                reqs = make_workload(tokenizer, "fixed", num_prompts, args.input_len,
                                     args.output_len, seed=1)
                spec = LoadSpec(max_concurrency=concurrency)
                # llama-server reads ignore_eos; llama_cpp.server has only the bias
                ignore = server == "folio" or args.llamacpp == "native"
                bench_serve(url, MODEL, reqs[:2], spec, ignore_eos=ignore,
                            extra=extra)  # warm-up
                report = bench_serve(url, MODEL, reqs, spec, ignore_eos=ignore, extra=extra)
                results[f"{server} {run}"] = report
                print(f"--- {server}, {run}\n{format_report(report)}", flush=True)
        finally:
            if server == "folio":
                ctx.__exit__(None, None, None)
            else:
                llama.close()
    return results, command


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llamacpp", default="native", choices=["native", "python"],
                   help="native llama-server -np N -cb, or llama-cpp-python's server")
    p.add_argument("--build-llamacpp", action="store_true",
                   help="build the native binaries first (benchmarks/llamacpp.py)")
    p.add_argument("--jobs", type=int, default=2, help="compile jobs for --build-llamacpp")
    p.add_argument("--install-llamacpp", action="store_true",
                   help="install llama-cpp-python into .venv-llamacpp (--llamacpp python)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="Folio's model.dtype (auto: float32 on CPUs without bf16)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf"],
                   help="Folio's model.quantization (auto: the GGUF stays quantized)")
    p.add_argument("--linear-backend", default="auto",
                   choices=["auto", "native", "kernel", "widen", "int8", "bf16dot", "amx"],
                   help="Folio's worker.linear_backend (int8: activations quantized per "
                        "block of 32, as llama.cpp's own Q4_1 x Q8_1 products)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.build_llamacpp:
        llamacpp.build(args.jobs)
    if args.install_llamacpp:
        install_llamacpp()
    if args.llamacpp == "python" and not (LLAMACPP_VENV / "bin" / "python").exists():
        raise SystemExit("llama-cpp-python is not installed; rerun with --install-llamacpp")
    machine_at_start = machine_facts()
    runs = {f"{args.concurrency} clients": (args.concurrency, args.num_prompts),
            "1 client": (1, 4)}
    results, command = run_both(runs, args)
    crowd = f"{args.concurrency} clients"
    ratio = (results[f"folio {crowd}"]["output_throughput"]
             / results[f"llama.cpp {crowd}"]["output_throughput"])
    print(f"{crowd}: Folio / llama.cpp aggregate output throughput {ratio:.2f}x "
          f"(target >= 3x); p99 TTFT {results[f'folio {crowd}']['ttft_ms']['p99']:.0f} vs "
          f"{results[f'llama.cpp {crowd}']['ttft_ms']['p99']:.0f} ms; p99 E2E "
          f"{results[f'folio {crowd}']['e2e_ms']['p99']:.0f} vs "
          f"{results[f'llama.cpp {crowd}']['e2e_ms']['p99']:.0f} ms")
    single = {s: 1000 / results[f"{s} 1 client"]["tpot_ms"]["mean"]
              for s in ("folio", "llama.cpp")}
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    folio_weights = (f"{dtype} (dequantised Q4_1)" if args.quantization == "none"
                     else f"the GGUF's Q4_1/Q8_0 blocks, {dtype} activations")
    if args.linear_backend == "int8":
        folio_weights += ", quantized to int8 per block of 32 for the products"
    failed = {s: results[f"{s} {crowd}"]["failed"] for s in ("folio", "llama.cpp")}
    print(f"1 client: decode {single['folio']:.1f} tok/s (Folio, {folio_weights}) vs "
          f"{single['llama.cpp']:.1f} tok/s (llama.cpp {args.llamacpp}, Q4_1); "
          f"client-side failures at {crowd}: {failed}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "workload": vars(args), "machine_at_start": machine_at_start,
            "machine_at_end": machine_facts(),
            "precision": {"folio": folio_weights, "llama.cpp": "Q4_1"},
            "llama.cpp command": command,
            "results": results, "aggregate_throughput_ratio": ratio,
            "single_stream_decode_tok_s": single, "failed": failed}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
