"""The C heap of a process that runs the model: keep its resident size near what is live.

glibc serves a large allocation (128 KiB and up, at first) from its own mmap, returned to
the OS when freed, but every such free raises that threshold to the freed size, up to
32 MiB. After the first prefill has freed a few activations or dequantised weights of
tens of MB, later ones come from the heap, and the heap keeps its free pages: a 1B
model's worker grew by about 150 MB over its first requests that way and stayed there.

:func:`bound_heap_growth` fixes the threshold at 32 MiB (which also turns off the
raising). Below it, a prefill's activations come from the heap and are reused layer after
layer: served from mmap instead (a 4 MiB threshold), every layer's gate/up output and
product were fresh pages, and the page faults took about a fifth of a 2,048-token prefill
step on a 2-core VM (0.95 -> 0.62 s a step once reused). What the step freed stays
in the heap until :class:`StepTrim` hands it back: after a step of many tokens (its ~70 MB
of temporaries back to the OS in about 2 ms), and after the first decode-only step that
follows new requests' prefill (a shorter prompt's temporaries, 20-45 MB that decode
steps never reuse; the trim costs about 0.1 ms then, once per arrival), or the worker's
idle trim does.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_MIN_TOKENS = 512  # steps this large trim after themselves (StepTrim)


@functools.cache
def _libc():
    """The C library, looked up once (find_library runs ldconfig in a subprocess)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def bound_heap_growth(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations of ``threshold`` bytes and up from mmap, for good; returns
    whether the C library took it (glibc's ``mallopt``; elsewhere nothing changes)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    took = libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1
    # and free space past 2x that at the top of the heap is trimmed as it appears
    return took and libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold) == 1


def single_arena() -> bool:
    """Every thread of this process allocates from glibc's main arena; returns whether the
    C library took it. Call before a second thread allocates: glibc fixes its arena limit
    when a thread first needs an arena of its own. A thread's own arena reserves 64 MiB
    and keeps what it once held scattered through it: the worker service's model thread
    held 23 MiB resident in one beside the main heap, about 30 MB of a 1B model's worker
    RSS at rest. Its threads rarely allocate at the same time (the model thread runs the
    steps; the event loop only frames messages), so one arena costs no contention."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return libc.mallopt(M_ARENA_MAX, 1) == 1


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps them otherwise): loading
    frees the float layers a quantized model replaced, about 80 MB of RSS for SmolLM2."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class StepTrim:
    """When a model process hands its heap's freed pages back: after a step of
    ``TRIM_MIN_TOKENS`` or more (prefill chunks: ~2 ms, well under 1% of such a step), and
    after the first decode-only step once new requests have started (their prefill's
    temporaries, which decode steps never reuse). Other steps keep what they freed for
    the next step to reuse."""

    def __init__(self) -> None:
        self.prefill_since_trim = False

    def after_step(self, num_tokens: int, num_new_reqs: int, decode_only: bool) -> bool:
        """Call after every step; returns whether it trimmed. ``decode_only``: every
        scheduled request computed exactly one token (no prompt, no drafts)."""
        after_prefill = decode_only and num_new_reqs == 0 and self.prefill_since_trim
        self.prefill_since_trim |= num_new_reqs > 0
        if num_tokens >= TRIM_MIN_TOKENS or after_prefill:
            release_freed_memory()
            self.prefill_since_trim = False
            return True
        return False
