"""Compile every Triton kernel for a real GPU target, on a machine without a GPU.

Run as ``TRITON_INTERPRET=0 python -m tests.kernels.triton_aot [sm ...]``. Each public
launcher (``ragged_paged_attention`` & co.) is called on CPU tensors with its kernels
swapped for recorders, so what gets compiled is exactly what the launcher would launch:
its argument dtypes, constexprs and num_warps. Each recorded launch is then compiled
through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas) for
``cuda:<sm>``. This catches what the interpreter cannot: tl.dot shapes under 16,
unsupported control flow, type mismatches, too much shared memory.

Prints one JSON line per compiled kernel and exits non-zero on the first failure.
"""
from __future__ import annotations

import json
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run with TRITON_INTERPRET=0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import reshape_and_cache, rms_norm, rotary_embedding  # noqa: E402
from kernels import triton_paged_attention as tpa  # noqa: E402

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}


class Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kw)`` records, runs nothing."""

    def __init__(self, fn, log: list):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.fn, args, kwargs))
        return launch


def _signature(fn, args, kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    return signature, constexprs, options


def record_launches() -> list:
    """Run each launcher over representative shapes with every kernel recorded."""
    log: list = []
    for module, name in [(tpa, "_ragged_paged_attention_kernel"),
                         (tpa, "_merge_splits_kernel"),
                         (reshape_and_cache, "_reshape_and_cache_kernel"),
                         (rms_norm, "_rms_norm_kernel"),
                         (rotary_embedding, "_rotary_kernel")]:
        setattr(module, name, Recorder(getattr(module, name), log))
    i32 = torch.int32
    for dtype, heads, kv_heads, head_dim, page, max_q, window, splits in [
            (torch.bfloat16, 9, 3, 64, 16, 1, None, 1),  # SmolLM2 decode
            (torch.bfloat16, 9, 3, 64, 16, 1, None, 8),  # split-KV (+ merge kernel)
            (torch.bfloat16, 9, 3, 64, 16, 64, None, 1),  # prefill chunks
            (torch.float16, 32, 8, 128, 32, 16, 4096, 1),  # Llama-3-8B-like, window
            (torch.float32, 12, 12, 80, 8, 1, None, 2)]:  # fp32 (ieee dots), hd 80
        cache = torch.empty(2, 4, page, kv_heads, head_dim, dtype=dtype)
        query = torch.empty(3, heads, head_dim, dtype=dtype)
        tpa.ragged_paged_attention(query, cache, torch.zeros(2, 2, dtype=i32),
                                   torch.ones(2, dtype=i32), torch.tensor([0, 1, 3], dtype=i32),
                                   max_q, 0.125, window, splits)
    for key_dtype, cache_dtype in [(torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.float16)]:
        key = torch.empty(3, 3, 64, dtype=key_dtype)
        reshape_and_cache.reshape_and_cache_triton(
            key, key, torch.empty(2, 4, 16, 3, 64, dtype=cache_dtype), torch.zeros(3).long())
    for dtype, hidden, residual in [(torch.bfloat16, 576, True), (torch.float32, 4096, False)]:
        x = torch.empty(2, hidden, dtype=dtype)
        rms_norm.rms_norm_triton(x, torch.empty(hidden, dtype=dtype), 1e-5,
                                 x if residual else None)
    q, k, cos = (torch.empty(2, 9, 64, dtype=torch.bfloat16),
                 torch.empty(2, 3, 64, dtype=torch.bfloat16),
                 torch.empty(2, 1, 32, dtype=torch.bfloat16))
    rotary_embedding.rotary_embedding_triton(q, k, cos, cos)
    return log


def main(sms: list[int]) -> int:
    launches = record_launches()
    for sm in sms:
        target = GPUTarget("cuda", sm, 32)
        for fn, args, kwargs in launches:
            signature, constexprs, options = _signature(fn, args, dict(kwargs))
            t0 = time.perf_counter()
            compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target,
                                      options=options)
            print(json.dumps({"kernel": fn.__name__, "sm": sm,
                              "seconds": round(time.perf_counter() - t0, 2),
                              "shared_bytes": compiled.metadata.shared,
                              "constexprs": {k: str(v) for k, v in constexprs.items()}}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
