"""Every Triton kernel, launched as its launcher launches it, compiles for an H100/H200.

The interpreter proves the kernels compute the right thing; this proves the same
source compiles to a cubin for sm_90 (ptxas ships with Triton; no GPU needed), with the
specialisation a live launch gets (alignment and divisibility hints), and records what
each kernel takes: registers, spills and shared memory. It runs in a subprocess
because kernels here were defined in interpreter mode. Compiled kernels land in
Triton's usual cache, so a rerun of unchanged kernels is fast. On a GPU,
benchmarks/gpu_check.sh runs the same module with --live and checks the driver's
register counts against these.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"_ragged_paged_attention_kernel", "_merge_splits_kernel",
            "_reshape_and_cache_kernel", "_rms_norm_kernel", "_rotary_kernel",
            "_lora_shrink_kernel", "_lora_expand_kernel"}


def test_kernels_compile_for_sm90_as_launched_live():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton_aot", "90"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {c["kernel"] for c in compiled} == EXPECTED
    assert len(compiled) >= 14
    # H100/H200 give a block at most 227 KiB of shared memory
    assert all(c["shared_bytes"] <= 227 * 1024 for c in compiled)
    # the live specialisation: every pointer is known 16-byte aligned
    for c in compiled:
        assert c["hinted_args"] and all(
            a.endswith("_ptr") or a.startswith("stride") for a in c["hinted_args"]), c
    attention = [c for c in compiled if c["kernel"] == "_ragged_paged_attention_kernel"]
    assert all("q_ptr" in c["hinted_args"] for c in attention)
    # SmolLM2's bf16 decode kernel: 72 registers live; unhinted it took 168 and spilled
    decode = next(c for c in attention if c["dtypes"] == ["bf16"]
                  and c["constexprs"]["BLOCK_M"] == "16")
    assert decode["registers"] <= 96, decode
    # no 16-bit kernel spills registers (the float32 attention with head_dim 80 padded
    # to 128 does: 255 registers; it is the reference dtype, not the served one)
    sixteen_bit = [c for c in compiled if {"bf16", "fp16"} & set(c["dtypes"])]
    assert len(sixteen_bit) >= 10
    for c in sixteen_bit:
        assert c["spill_stores"] == 0 and c["stack_bytes"] == 0, c
    assert all(c["registers"] <= 255 for c in compiled)
