"""worker/heap.py: a step's freed temporaries stay in the heap for the next step to reuse,
a large step hands them back afterwards, so does the first decode-only step after new
requests' prefill, and allocations past the threshold never stay resident."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

SCRIPT = textwrap.dedent("""
    import torch
    from worker.heap import TRIM_MIN_TOKENS, StepTrim, bound_heap_growth
    assert bound_heap_growth()
    def anon_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon"):
                return int(line.split()[1]) // 1024
    base = anon_mib()
    huge = torch.empty(12 << 20).fill_(1)   # 48 MiB: past the threshold, mmapped
    del huge
    after_huge = anon_mib() - base
    held = [torch.empty(2 << 20).fill_(1) for _ in range(8)]   # 8 MiB each: the heap
    last = held.pop()   # kept: the heap's top cannot be trimmed below it
    del held
    freed = anon_mib() - base
    trim = StepTrim()
    assert not trim.after_step(TRIM_MIN_TOKENS - 1, 0, False)
    after_small_step = anon_mib() - base
    assert trim.after_step(TRIM_MIN_TOKENS, 0, False)
    print(after_huge, freed, after_small_step, anon_mib() - base)
""")


def test_temporaries_stay_until_a_large_step_trims_them():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, cwd=".")
    after_huge, freed, after_small_step, after_large_step = (
        int(v) for v in out.stdout.split()[-4:])
    assert after_huge <= 4             # mmapped, unmapped when freed
    assert freed >= 48                 # 7 x 8 MiB kept for the next step
    assert after_small_step >= 48      # a small step keeps them
    assert after_large_step <= 16      # a large step hands them back: the 8 MiB held


def test_first_decode_only_step_after_new_requests_trims():
    from worker.heap import StepTrim
    trim = StepTrim()
    assert not trim.after_step(4, 0, True)        # decoding, nothing new: keep
    assert not trim.after_step(130, 1, False)     # a short prompt's prefill: keep
    assert not trim.after_step(9, 0, False)       # drafts verified: not decode-only
    assert trim.after_step(4, 0, True)            # the first decode-only step after it
    assert not trim.after_step(4, 0, True)        # once per arrival
    assert not trim.after_step(5, 1, True)        # a one-token prompt is decode-shaped...
    assert trim.after_step(5, 0, True)            # ...and trims on the step after


ARENA_SCRIPT = textwrap.dedent("""
    import sys, threading
    from worker.heap import single_arena
    if sys.argv[1] == "single":
        assert single_arena()
    kept = []
    def allocate():  # 100 KB each: under glibc's mmap threshold, so from an arena
        kept.extend(bytearray(100_000) for _ in range(64))
    thread = threading.Thread(target=allocate)
    thread.start()
    thread.join()
    # a thread's own arena is a 64 MiB reservation: its unused part maps as ---p
    reserved = 0
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if len(fields) == 5 and fields[1] == "---p" and hi - lo > (16 << 20):
            reserved += 1
    print(reserved)
""")


@pytest.mark.parametrize("mode", ["single", "default"])
def test_a_thread_allocates_from_the_main_arena_after_single_arena(mode):
    out = subprocess.run([sys.executable, "-c", ARENA_SCRIPT, mode], capture_output=True,
                         text=True, check=True, cwd=".")
    reserved = int(out.stdout.split()[-1])
    # the default is glibc's: the thread got an arena of its own (the control)
    assert reserved == 0 if mode == "single" else reserved >= 1
