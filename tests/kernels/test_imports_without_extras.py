"""The kernels, their tests and the GPU path import on a bare GPU machine.

That machine (benchmarks/gpu_check.sh) has torch and Triton but no structlog, gguf or
OpenTelemetry. Each check runs in a fresh interpreter with those modules blocked
(``sys.modules[name] = None`` makes any import of them raise ImportError).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("structlog", "gguf", "opentelemetry")
KERNEL_TESTS = ["tests/kernels/test_triton_paged_attention.py",
                "tests/kernels/test_triton_small_kernels.py",
                "tests/kernels/test_paged_attention.py",
                "tests/kernels/test_triton_quant_linear.py"]
GPU_PATH = ["kernels.rms_norm", "kernels.reshape_and_cache", "kernels.rotary_embedding",
            "kernels.paged_attention", "kernels.triton_paged_attention",
            "kernels.quant_linear", "kernels.triton_quant_linear",
            "kernels.cpu_paged_attention", "worker.cuda_graphs", "worker.gpu_memory",
            "worker.sampler", "worker.sampling_metadata"]


def _run_blocked(code: str) -> subprocess.CompletedProcess:
    prelude = f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None\n"
    env = dict(os.environ, TRITON_INTERPRET="1", FOLIO_DISABLE_CPU_KERNELS="1")
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_blocking_works():
    proc = _run_blocked("import structlog")
    assert proc.returncode != 0 and "import of structlog halted" in proc.stderr


def test_gpu_path_and_kernel_tests_import_without_extras():
    code = f"""
import importlib, json
for name in {GPU_PATH!r}:
    importlib.import_module(name)
import pytest
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *{KERNEL_TESTS!r}])
print(json.dumps({{"collect_rc": int(rc),
                  "loaded": sorted(m for m in {BLOCKED!r} if sys.modules.get(m))}}))
"""
    proc = _run_blocked(code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"collect_rc": 0, "loaded": []}
    counts = dict(line.rsplit(": ", 1) for line in proc.stdout.splitlines()
                  if line.startswith("tests/"))
    assert set(counts) == set(KERNEL_TESTS) and all(int(n) > 0 for n in counts.values())


def test_logging_falls_back_to_the_standard_library():
    code = """
from observability.logging import RateLimitedLog, configure_logging, get_logger
import observability.logging as folio_logging
assert folio_logging.structlog is None
configure_logging("info", "console")
log = get_logger("folio.test")
log.debug("hidden", n=0)
log.info("kv cache allocated", num_blocks=12, sized_by="memory.num_blocks")
RateLimitedLog(log).event("flood", "client misbehaved", peer="x")
configure_logging("warning", "json")
log.info("dropped")
log.bind(step=3).warning("slow step", seconds=1.5)
"""
    proc = _run_blocked(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].endswith("folio.test: kv cache allocated num_blocks=12 "
                             "sized_by='memory.num_blocks'")
    assert "[WARNING]" in lines[1] and "num_events=1" in lines[1]
    assert json.loads(lines[2]) == {"event": "slow step", "level": "warning",
                                    "logger": "folio.test", "step": 3, "seconds": 1.5}
