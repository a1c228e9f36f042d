"""Every Triton kernel, launched as its launcher launches it, compiles for an H100/H200.

The interpreter proves the kernels compute the right thing; this proves the same
source compiles to a cubin for sm_90 (ptxas ships with Triton; no GPU needed). It
runs in a subprocess because kernels here were defined in interpreter mode.
Compiled kernels land in Triton's usual cache, so a rerun of unchanged kernels is fast.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"_ragged_paged_attention_kernel", "_merge_splits_kernel",
            "_reshape_and_cache_kernel", "_rms_norm_kernel", "_rotary_kernel"}


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton_aot", "90"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {c["kernel"] for c in compiled} == EXPECTED
    assert len(compiled) >= 12
    # H100/H200 give a block at most 227 KiB of shared memory
    assert all(c["shared_bytes"] <= 227 * 1024 for c in compiled)
