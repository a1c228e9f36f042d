"""What a compiled kernel takes on the chip, read from its cubin with the cuobjdump that
ships with Triton (no GPU needed).

``registers`` per thread, ``stack_bytes`` (the stack frame, where ptxas spills),
``local_bytes``, ``static_shared_bytes`` (Triton asks for its shared memory at launch:
that is the compiled kernel's ``metadata.shared``), and ``spill_stores``: the number of
store-to-local instructions (``STL``) in the machine code, i.e. register spills.
"""
from __future__ import annotations

import re
import subprocess
import tempfile

_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_SPILL_STORE = re.compile(r"\bSTL(\.\w+)?\b")


def _cuobjdump() -> str:
    from triton import knobs
    return knobs.nvidia.cuobjdump.path


def _cuobjdump_output(cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), *flags, f.name], capture_output=True,
                              text=True, check=True).stdout


def cubin_resources(cubin: bytes) -> dict:
    """Resource usage of the one kernel in ``cubin``. Spills need a stack frame, so the
    machine code (slow to dump) is only read when there is one."""
    usage = _cuobjdump_output(cubin, "--dump-resource-usage")
    match = _USAGE.search(usage)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{usage}")
    registers, stack, shared, local = (int(g) for g in match.groups())
    spill_stores = 0
    if stack or local:
        sass = _cuobjdump_output(cubin, "--dump-sass")
        spill_stores = sum(bool(_SPILL_STORE.search(line)) for line in sass.splitlines())
    return {"registers": registers, "stack_bytes": stack, "static_shared_bytes": shared,
            "local_bytes": local, "spill_stores": spill_stores}
