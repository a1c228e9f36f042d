"""Serving side by side: `folio serve` and llama-cpp-python's OpenAI server on the same
GGUF file (SmolLM2-135M-Instruct Q4_1), same machine, same client (`folio bench serve`'s),
in one run: aggregate throughput and latency at fixed concurrency, and single-stream
decode speed.

Precision differs and the report says so: llama.cpp computes on the 4-bit weights,
Folio on weights dequantised to float32 (or bf16 with ``--dtype bfloat16``). Both are
told to ignore EOS (Folio with ``ignore_eos``, llama.cpp with a -100 logit bias on the
end tokens) so both generate exactly the requested lengths.

llama-cpp-python is an optional baseline; this script installs it on request into its
own environment (`--install-llamacpp`, a 5-minute compile), never into Folio's:

    .venv/bin/python benchmarks/serve_vs_llamacpp.py --install-llamacpp \
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


class LlamaCppServer:
    """llama_cpp.server on the default GGUF, n_threads = 2, context 2048."""

    def __init__(self, threads: int):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [str(LLAMACPP_VENV / "bin" / "python"), "-m", "llama_cpp.server",
             "--model", str(default_model_path()), "--model_alias", MODEL,
             "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", "2048",
             "--n_threads", str(threads), "--n_threads_batch", str(threads),
             "--interrupt_requests", "False"],  # queue concurrent requests, do not cut them
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("llama_cpp.server did not start")
                time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_both(runs: dict, args) -> dict:
    tokenizer = Tokenizer.from_model_path("default")
    eos_bias = {"logit_bias": {str(t): -100 for t in tokenizer.eos_token_ids}}
    results = {}
    folio_settings = {"model": {"max_model_len": 2048, "dtype": args.dtype},
                      "observability": {"log_level": "warning"}}
    servers = (("folio", None), ("llama.cpp", eos_bias))
    for server, extra in servers:
        if server == "folio":
            ctx = serving(folio_settings)
            url, _ = ctx.__enter__()
        else:
            llama = LlamaCppServer(args.threads)
            url = llama.url
        try:
            for run, (concurrency, num_prompts) in runs.items():
                reqs = make_workload(tokenizer, "fixed", num_prompts, args.input_len,
                                     args.output_len, seed=1)
                spec = LoadSpec(max_concurrency=concurrency)
                bench_serve(url, MODEL, reqs[:2], spec, ignore_eos=extra is None,
                            extra=extra)  # warm-up
                report = bench_serve(url, MODEL, reqs, spec, ignore_eos=extra is None,
                                     extra=extra)
                results[f"{server} {run}"] = report
                print(f"--- {server}, {run}\n{format_report(report)}", flush=True)
        finally:
            if server == "folio":
                ctx.__exit__(None, None, None)
            else:
                llama.close()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install-llamacpp", action="store_true")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="Folio's model.dtype (auto: float32 on CPUs without bf16)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.install_llamacpp:
        install_llamacpp()
    if not (LLAMACPP_VENV / "bin" / "python").exists():
        raise SystemExit("llama-cpp-python is not installed; rerun with --install-llamacpp")
    runs = {f"{args.concurrency} clients": (args.concurrency, args.num_prompts),
            "1 client": (1, 4)}
    results = run_both(runs, args)
    crowd = f"{args.concurrency} clients"
    ratio = (results[f"folio {crowd}"]["output_throughput"]
             / results[f"llama.cpp {crowd}"]["output_throughput"])
    print(f"{crowd}: Folio / llama.cpp aggregate output throughput {ratio:.2f}x "
          f"(target >= 5x); p99 TTFT {results[f'folio {crowd}']['ttft_ms']['p99']:.0f} vs "
          f"{results[f'llama.cpp {crowd}']['ttft_ms']['p99']:.0f} ms; p99 E2E "
          f"{results[f'folio {crowd}']['e2e_ms']['p99']:.0f} vs "
          f"{results[f'llama.cpp {crowd}']['e2e_ms']['p99']:.0f} ms")
    single = {s: 1000 / results[f"{s} 1 client"]["tpot_ms"]["mean"]
              for s in ("folio", "llama.cpp")}
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    print(f"1 client: decode {single['folio']:.1f} tok/s (Folio, {dtype} weights) vs "
          f"{single['llama.cpp']:.1f} tok/s (llama.cpp, 4-bit weights)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "workload": vars(args), "precision": {"folio": f"{dtype} (dequantised Q4_1)",
                                                  "llama.cpp": "Q4_1"},
            "results": results, "aggregate_throughput_ratio": ratio,
            "single_stream_decode_tok_s": single}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
