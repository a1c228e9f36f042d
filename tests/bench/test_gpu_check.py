"""benchmarks/gpu_check.sh runs end to end without a GPU (--quick: a smoke-sized run).

On the CPU every section still runs: interpreted kernel tests, parity against Hugging
Face on a tiny random model, and the benchmark on the reference backend. The script
writes $OUT/gpu_check.json, which is checked here section by section.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/usr/bin/timeout").exists() and not Path("/bin/timeout").exists(),
                    reason="needs coreutils' timeout")
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("FOLIO_WHEELS", "TRITON_INTERPRET")}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, TMPDIR=str(tmp_path),
               FOLIO_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--quick"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    result = json.loads((tmp_path / "out/gpu_check.json").read_text())
    assert (tmp_path / "out/gpu_check.log").read_text().count("=== summary ===") == 1
    sections = result["sections"]
    assert result["ok"] and result["env"]["cuda"] is False
    for name in ("preflight", "kernels", "parity", "bench"):
        assert sections[name]["status"] == "passed", (name, log[-4000:])
    assert sections["wheels"]["status"] in ("passed", "skipped")
    assert "passed" in log and "3/3 greedy continuations" in log
    bench = result["bench"]
    assert bench["device"] == "cpu" and bench["attention_backend"] == "torch"
    assert bench["cuda_graphs"] is False
    assert set(bench["decode_step_ms"]) == {"1", "32", "256"}
    assert all(row["eager"] > 0 for row in bench["decode_step_ms"].values())
    assert bench["folio"]["output_tok_s"] > 0 and bench["hf_generate"]["output_tok_s"] > 0
    assert bench["parity"]["identical"] == bench["parity"]["prompts"] == 1
