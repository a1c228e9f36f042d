"""Compile every Triton kernel for a real GPU target, on a machine without a GPU.

Run as ``TRITON_INTERPRET=0 python -m tests.kernels.triton_aot [sm ...] [--live]``.
Each public launcher (``ragged_paged_attention`` & co.) is called with its kernels
swapped for recorders, so what gets compiled is exactly what the launcher would
launch: its arguments, constexprs and num_warps. Each recorded launch is then compiled
through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas) for
``cuda:<sm>`` with the *live* specialisation: Triton's own binder works out, from the
argument values, the hints a real launch adds (pointers 16-byte aligned, integers
divisible by 16 or equal to 1). Without them ptxas sees another kernel (the bf16
decode attention took 168 registers and scalar loads instead of 72 and vector loads).
This catches what the interpreter cannot: tl.dot shapes under 16, unsupported control
flow, type mismatches, too much shared memory, register spills.

``--live`` (on a GPU) launches every recorded call for real on CUDA tensors and checks
that the driver's register count for each kernel equals the offline compile's.

Prints one JSON line per compiled kernel and exits non-zero on a failure or mismatch.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run with TRITON_INTERPRET=0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from kernels import triton_lora, triton_reshape_and_cache, triton_rms_norm  # noqa: E402
from kernels import triton_rotary_embedding  # noqa: E402
from kernels.lora_mapping import make_lora_mapping  # noqa: E402
from kernels import triton_paged_attention as tpa  # noqa: E402
from tests.kernels.cubin_resources import cubin_resources  # noqa: E402

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
KERNELS = [(tpa, "_ragged_paged_attention_kernel"), (tpa, "_merge_splits_kernel"),
           (triton_reshape_and_cache, "_reshape_and_cache_kernel"),
           (triton_rms_norm, "_rms_norm_kernel"), (triton_rotary_embedding, "_rotary_kernel"),
           (triton_lora, "_lora_shrink_kernel"), (triton_lora, "_lora_expand_kernel")]


@dataclass(slots=True)
class Launch:
    """One kernel launch as a launcher made it (and, when run live, what it compiled)."""

    fn: object  # the JITFunction
    args: tuple
    kwargs: dict
    live: object = None  # the CompiledKernel a real launch used

    @property
    def dtypes(self) -> list[str]:
        return sorted({_TYPES[a.dtype] for a in self.args
                       if isinstance(a, torch.Tensor) and a.dtype in _TYPES})


class Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kw)`` records the launch;
    with ``live`` it also launches it for real and keeps the compiled kernel."""

    def __init__(self, fn, log: list, live: bool):
        self.fn, self.log, self.live = fn, log, live

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            entry = Launch(self.fn, args, dict(kwargs))
            if self.live:
                entry.live = self.fn[grid](*args, **kwargs)
            self.log.append(entry)
        return launch


def _call_launchers(device: str) -> None:
    """The launchers over representative shapes (decode, split-KV, prefill, GQA 4 with a
    window, float32, fp8 KV caches; cache writes, norms, rotary)."""
    i32 = torch.int32
    for dtype, heads, kv_heads, head_dim, page, max_q, window, splits in [
            (torch.bfloat16, 9, 3, 64, 16, 1, None, 1),  # SmolLM2 decode
            (torch.bfloat16, 9, 3, 64, 16, 1, None, 8),  # split-KV (+ merge kernel)
            (torch.bfloat16, 9, 3, 64, 16, 64, None, 1),  # prefill chunks
            (torch.bfloat16, 16, 2, 128, 16, 1, None, 4),  # Llama-3-like: hd 128, group 8
            (torch.float16, 32, 8, 128, 32, 16, 4096, 1),  # Llama-3-8B-like, window
            (torch.float32, 12, 12, 80, 8, 1, None, 2)]:  # fp32 (ieee dots), hd 80
        cache = torch.empty(2, 4, page, kv_heads, head_dim, dtype=dtype, device=device)
        query = torch.empty(3, heads, head_dim, dtype=dtype, device=device)
        tpa.ragged_paged_attention(query, cache, torch.zeros(2, 2, dtype=i32, device=device),
                                   torch.ones(2, dtype=i32, device=device),
                                   torch.tensor([0, 1, 3], dtype=i32, device=device),
                                   max_q, 0.125, window, splits)
    for kv_dtype, max_q in [(torch.float8_e4m3fn, 1), (torch.float8_e5m2, 64)]:
        # an fp8 KV cache under bf16 queries (memory.kv_cache_dtype): decode, prefill
        cache = torch.empty(2, 4, 16, 3, 64, dtype=kv_dtype, device=device)
        query = torch.empty(3, 9, 64, dtype=torch.bfloat16, device=device)
        tpa.ragged_paged_attention(query, cache, torch.zeros(2, 2, dtype=i32, device=device),
                                   torch.ones(2, dtype=i32, device=device),
                                   torch.tensor([0, 1, 3], dtype=i32, device=device),
                                   max_q, 0.125)
    for key_dtype, cache_dtype in [(torch.bfloat16, torch.bfloat16),
                                   (torch.float32, torch.float16),
                                   (torch.bfloat16, torch.float8_e4m3fn)]:
        key = torch.empty(3, 3, 64, dtype=key_dtype, device=device)
        triton_reshape_and_cache.reshape_and_cache_triton(
            key, key, torch.empty(2, 4, 16, 3, 64, dtype=cache_dtype, device=device),
            torch.zeros(3, dtype=torch.int64, device=device))
    for dtype, hidden, residual in [(torch.bfloat16, 576, True), (torch.float32, 4096, False)]:
        x = torch.empty(2, hidden, dtype=dtype, device=device)
        weight = torch.empty(hidden, dtype=dtype, device=device)
        triton_rms_norm.rms_norm_triton(x, weight, 1e-5, x if residual else None)
    q, k, cos = (torch.empty(2, 9, 64, dtype=torch.bfloat16, device=device),
                 torch.empty(2, 3, 64, dtype=torch.bfloat16, device=device),
                 torch.empty(2, 1, 32, dtype=torch.bfloat16, device=device))
    triton_rotary_embedding.rotary_embedding_triton(q, k, cos, cos)
    _call_lora_launchers(device)


def _call_lora_launchers(device: str) -> None:
    """LoRA shrink and expand on SmolLM2's q/k/v (rank 16: three slices of 16 over 576
    inputs, the q slice's 576 columns of the 960 out), slots stored transposed as the
    worker stores them, in the served bf16 and the reference float32."""
    mapping = make_lora_mapping([0, -1, 1], [0, 1, 2, 5], torch.device(device))
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(5, 576, dtype=dtype, device=device)
        a = torch.empty(4, 576, 48, dtype=dtype, device=device).transpose(1, 2)
        xa = triton_lora.lora_shrink_triton(x, a, mapping)
        y = torch.empty(5, 960, dtype=dtype, device=device)
        b = torch.empty(4, 16, 960, dtype=dtype, device=device).transpose(1, 2)
        triton_lora.lora_expand_triton(y[:, :576], xa[:, :16], b[:, :576], mapping)


def record_launches(device: str = "cpu", live: bool = False) -> list[Launch]:
    """Every launch the launchers make over the representative shapes."""
    log: list[Launch] = []
    originals = {(m, name): getattr(m, name) for m, name in KERNELS}
    for (module, name), fn in originals.items():
        setattr(module, name, Recorder(fn, log, live))
    try:
        _call_launchers(device)
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    return log


def compile_offline(launch: Launch, target: GPUTarget):
    """Compile ``launch`` for ``target`` exactly as JITFunction.run would on that GPU:
    the same binder turns argument values into the signature, constexprs and hints."""
    fn, kwargs = launch.fn, dict(launch.kwargs)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    hinted = sorted(fn.arg_names[path[0]] for path, hints in attrs.items() if hints)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    return compiled, hinted, {fn.arg_names[p[0]]: str(v) for p, v in constexprs.items()}


def report(launch: Launch, sm: int) -> dict:
    t0 = time.perf_counter()
    compiled, hinted, constexprs = compile_offline(launch, GPUTarget("cuda", sm, 32))
    row = {"kernel": launch.fn.__name__, "sm": sm, "dtypes": launch.dtypes,
           "seconds": round(time.perf_counter() - t0, 2),
           "shared_bytes": compiled.metadata.shared,
           **cubin_resources(compiled.asm["cubin"]), "hinted_args": hinted,
           "constexprs": constexprs}
    if launch.live is not None:
        launch.live._init_handles()  # loads the cubin: the driver's counts (a no-op if run)
        row.update(live_registers=launch.live.n_regs, live_spills=launch.live.n_spills,
                   live_matches=launch.live.n_regs == row["registers"])
    return row


def main(sms: list[int], live: bool) -> int:
    if live:  # the GPU's own target, so offline and live compile for the same chip
        major, minor = torch.cuda.get_device_capability()
        sms = [major * 10 + minor]
    launches = record_launches("cuda" if live else "cpu", live)
    ok = True
    for sm in sms:
        for launch in launches:
            row = report(launch, sm)
            ok &= row.get("live_matches", True)
            print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    sys.exit(main([int(a) for a in sys.argv[1:] if not a.startswith("--")] or [90],
                  "--live" in flags))
