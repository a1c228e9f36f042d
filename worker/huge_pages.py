"""The model's weights in one buffer on transparent huge pages (CPU).

A decode step streams every weight from memory. Held as separate tensors of a few
hundred KB to a few MB each (a quantized small model's layers are all under 2 MB), the
weights sit on 4 KB pages: the streaming reads then miss the TLB every 4 KB and the
hardware prefetchers stop at every page edge. Copied into one buffer whose 2 MB-aligned
range is advised ``MADV_HUGEPAGE`` before its first touch, they sit on 2 MB pages
instead (where the kernel has transparent huge pages in ``madvise`` or ``always`` mode).

Each tensor keeps its Python object and its view geometry: :func:`move_to_huge_pages`
re-points the existing tensors (``Tensor.set_``) at their copy, so every holder of a
weight (tied embeddings, a K-major head copy, a packed weight's ``qs``/``scales``) sees
the move, and tensors sharing a storage keep sharing one copy. Call it before anything
keeps raw pointers into the weights (the oneDNN packs, the fused decode layer).

torch's own switch (``THP_MEM_ALLOC_ENABLE``: every tensor of 2 MB and more 2 MB-aligned
and advised) was measured too: 3-6% faster offline in three alternated pairs of Folio
alone, within noise in two pairs beside HF `generate` (which it speeds up as well), and
~25 MB more resident in the served worker; it is left off.
"""
from __future__ import annotations

import mmap

import torch
from torch import nn

from observability.logging import get_logger

log = get_logger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
ALIGN = 64  # each storage starts on a cache line (and any element size divides it)
MIN_BYTES = 64 * 1024 * 1024  # smaller models stay as loaded (a 2 MB page is no gain)


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of ``nbytes`` in fresh anonymous memory (zeros, untouched) whose
    2 MB-aligned span is advised for huge pages; None where the platform cannot.

    The memory is mapped here rather than taken from the C heap: the heap hands back
    pages an earlier allocation already faulted in as 4 KB pages, which stay so."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
        skip = -raw.data_ptr() % HUGE_PAGE
        start = skip // mmap.PAGESIZE * mmap.PAGESIZE
        region.madvise(mmap.MADV_HUGEPAGE, start, len(region) - start)
    except (OSError, ValueError):
        return None
    return raw[skip:skip + nbytes]


def _weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The weights: every parameter, the fields of packed quantized weights (anything
    with ``qs`` and ``scales``) and a K-major head copy (``head_weight``). Buffers (RoPE
    tables) stay where they are, so that dropping the parameters and the head copy
    (sleep level 2, worker/sleep_mode.py) drops the whole buffer."""
    found: dict[int, torch.Tensor] = {}

    def add(value) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif hasattr(value, "qs") and hasattr(value, "scales"):
            add(value.qs)
            add(value.scales)

    for tensor in model.parameters():
        add(tensor)
    for module in model.modules():
        for value in vars(module).values():
            if not isinstance(value, torch.Tensor):
                add(value)
    add(getattr(model, "head_weight", None))
    return [t for t in found.values() if t.device.type == "cpu" and not t.is_sparse]


@torch.no_grad()
def move_to_huge_pages(model: nn.Module, min_bytes: int | None = None) -> int:
    """Copy ``model``'s CPU weights into one huge-page buffer and re-point them there.
    Returns the bytes moved (0: nothing done, the weights total under ``min_bytes``
    (default MIN_BYTES), or the platform has no huge pages)."""
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    by_storage: dict[int, list[torch.Tensor]] = {}
    for tensor in _weight_tensors(model):
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    storages = {ptr: ts[0].untyped_storage() for ptr, ts in by_storage.items()}
    offsets, total = {}, 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    if total < min_bytes:
        return 0
    buf = huge_page_buffer(total)
    if buf is None:
        return 0
    arena = buf.untyped_storage()
    base = buf.data_ptr() - arena.data_ptr()  # bytes from the storage's start
    for ptr, tensors in by_storage.items():
        storage, start = storages.pop(ptr), base + offsets[ptr]
        buf[offsets[ptr]:offsets[ptr] + storage.nbytes()].copy_(
            torch.empty(0, dtype=torch.uint8).set_(storage))
        for tensor in tensors:  # the old storage goes with its last tensor: no 2x peak
            size = tensor.element_size()
            tensor.set_(arena, start // size + tensor.storage_offset(), tensor.size(),
                        tensor.stride())
        del storage
    log.debug("weights on huge pages", bytes=total, tensors=sum(map(len, by_storage.values())))
    return total
