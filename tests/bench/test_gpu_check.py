"""benchmarks/gpu_check.sh --dry-run runs every section on the CPU backends.

It builds the wheel folder from the package index, checks its size and tags, installs
it as the GPU machine would, then runs the kernel tests (interpreted), the offline
sm_90 compile, the worker tests (the GPU ones skip), the fp8 KV cache kernels, parity against Hugging Face and
both benchmarks on 2-layer versions of the random checkpoints, then the LoRA kernels and
the LoRA benchmark (tiny model). It ends with one JSON summary, checked here section by
section.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["preflight", "wheels-build", "wheels", "kernels", "compile", "worker", "kv-fp8",
            "parity", "bench-small", "bench-1b", "lora-kernels", "lora-bench"]


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_gpu_check_dry_run(tmp_path, gpu_wheel_folder):
    env = {k: v for k, v in os.environ.items() if k not in ("FOLIO_WHEELS", "TRITON_INTERPRET")}
    # the native CPU kernels are no part of this check: don't spend a minute building them
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, TMPDIR=str(tmp_path),
               FOLIO_CACHE_DIR=str(tmp_path / "cache"), FOLIO_DISABLE_CPU_KERNELS="1")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--dry-run",
                           "--wheels", str(gpu_wheel_folder)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert log.count("=== summary ===") == 1
    tail = proc.stdout[proc.stdout.rindex("\n{\n") + 1:]  # the last thing printed
    headline = json.loads(tail)
    details = json.loads((tmp_path / "out/gpu_check.json").read_text())
    assert details["headline"] == headline
    assert headline["ok"] and headline["mode"] == "dry-run" and headline["device"] == "cpu"
    assert headline["sections"] == {name: "passed" for name in SECTIONS}, log[-4000:]
    assert headline["wheels"]["ok"] and headline["wheels"]["files"] == 2
    assert headline["wheels"]["with_tree_mib"] < 64
    assert headline["compile"]["kernels"] >= 14 and headline["compile"]["spilling_16bit"] == 0
    assert set(headline["parity"]) == {"smollm2-random (small)", "llama3-random (small)"}
    for model in headline["parity"].values():
        assert model["greedy_float32"] == {"eager": "3/3"} and model["ok"]
    assert set(headline["bench"]) == {"smollm2", "tinyllama"}
    for name, bench in details["bench"].items():
        assert bench["device"] == "cpu" and bench["cuda_graphs"] is False
        assert set(bench["decode_step_ms"]) == {"1", "4", "16"}  # 1, 32, 256 on a GPU
        for row in bench["decode_step_ms"].values():
            assert row["eager"] > 0 and row["parts"]["eager"]["sample"] > 0
        assert bench["folio"]["output_tok_s"] > 0 and bench["hf_generate"]["output_tok_s"] > 0
    lora = headline["lora"]  # the multi-LoRA benchmark, on the tiny model
    assert all(lora["tok_s"][k] > 0 for k in ("base", "mixed", "naive"))
    assert details["lora"]["mixed"]["output_tokens"] == details["lora"]["base"]["output_tokens"]
