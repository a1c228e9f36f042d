"""What a benchmark result was measured on: CPU model and its vector flags, threads,
torch version, the machine's load while it ran, and (on request) memory bandwidth
measured in the same run.

Every benchmark records these next to its figures: CPUs of this project differ (AVX-512
with or without bf16 and VNNI, AMX), and the machines are shared, so a figure means
little without the CPU it ran on and how busy that was.
"""
from __future__ import annotations

import os
import platform
import time

import torch

# Flags that decide which kernels run (the rest of /proc/cpuinfo's list is noise here).
_VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                 "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model_and_flags() -> tuple[str, list[str]]:
    fields = _cpuinfo()
    present = set(fields.get("flags", "").split())
    return (fields.get("model name") or platform.processor() or platform.machine(),
            [f for f in _VECTOR_FLAGS if f in present])


def cpu_family_model() -> str:
    """``family F model M`` from /proc/cpuinfo ("" where absent): a VM's model name can
    be as bare as ``AMD EPYC``, and two machines of that name here were a Zen 4 (family
    25, model 17) and, by its flags (AVX-VNNI), a later core whose bf16 linears ran
    about twice as fast."""
    fields = _cpuinfo()
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']} model {fields['model']}"


def machine_facts() -> dict:
    """CPU, threads, torch and the load average now (call at the end of a run too)."""
    model, flags = cpu_model_and_flags()
    return {"cpu_model": model, "cpu_family_model": cpu_family_model(),
            "cpu_flags": flags, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def memory_bandwidth_gb_s(size_mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth, GB/s: the best of ``repeats`` sums over a buffer far larger than
    the caches, on torch's threads (what a decode step's weight streaming can reach).
    Measured on 4 KB pages and on transparent huge pages (where the weights sit,
    worker/huge_pages.py), the higher counts: here a sum read ~24 GB/s from the first
    and ~30 GB/s from the second."""
    from worker.huge_pages import huge_page_buffer
    nbytes = size_mib * 2 ** 20
    huge = huge_page_buffer(nbytes)
    buffers = [torch.ones(nbytes // 4)] + ([] if huge is None else [huge.view(torch.float32)])
    best = float("inf")
    for buf in buffers:
        buf.fill_(1.0)  # first touch
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
