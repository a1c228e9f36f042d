"""worker/heap.py: a step's freed temporaries stay in the heap for the next step to reuse,
a large step hands them back afterwards, and allocations past the threshold never stay
resident."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

SCRIPT = textwrap.dedent("""
    import torch
    from worker.heap import TRIM_MIN_TOKENS, bound_heap_growth, trim_after_step
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
    trim_after_step(TRIM_MIN_TOKENS - 1)
    after_small_step = anon_mib() - base
    trim_after_step(TRIM_MIN_TOKENS)
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
