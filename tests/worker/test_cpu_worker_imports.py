"""A CPU worker never loads Triton: its kernels are the GPU path's, and importing it costs
the worker about 70 MB of RSS (libtriton) and start-up time. The Triton kernels live in
``kernels/triton_*.py`` and are imported only where a CUDA tensor takes them."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import services.worker_service.service  # what `python -m services.worker_service` imports
from folio import LLM, SamplingParams
llm = LLM(model=sys.argv[1], tokenizer=sys.argv[2], dtype="float32", max_model_len=64, kv_cache_bytes=1 << 22,
          num_threads=1, **{"observability.log_level": "warning"})
out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))
print(json.dumps({"tokens": len(out[0].outputs[0].token_ids),
                  "triton": sorted(m for m in sys.modules if m.split(".")[0] == "triton")}))
"""


def test_a_cpu_worker_runs_steps_without_importing_triton(tiny_llama_dir, default_model_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_dir),
                           str(default_model_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 3
    assert result["triton"] == []
