"""Native CPU decode paged attention, compiled at first use.

``csrc/paged_attention_decode.cpp`` is built with ``torch.utils.cpp_extension.load``
the first time :func:`is_available` or :func:`paged_attention_decode` is called, then
loaded from the build folder on later starts (a warm load takes well under a second; a
cold build a few tens of seconds). It registers ``torch.ops.folio.paged_attention_decode``.

Build folder: ``$FOLIO_CACHE_DIR/torch_extensions/<name>`` when ``FOLIO_CACHE_DIR`` is
set to a directory, else torch's default (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``). ``<name>`` hashes the source, the flags, the torch
version and the CPU's feature flags: the build uses ``-march=native``, so a cache shared
between different CPUs must never hand one machine another's binary.

``FOLIO_DISABLE_CPU_KERNELS=1`` switches the kernels off (``is_available()`` is False
and nothing is built, unless it was already loaded). Any build or load failure is logged once, as a warning with its
reason, and ``is_available()`` stays False for the life of the process, so callers fall
back to the torch reference in ``kernels.paged_attention``.

Threads: the kernel splits work with ``at::parallel_for``, i.e. torch's own OpenMP pool
(``torch.set_num_threads`` applies); it links the libgomp torch already loaded.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
import warnings
from pathlib import Path

import torch

from observability.logging import get_logger

log = get_logger(__name__)

DISABLE_ENV = "FOLIO_DISABLE_CPU_KERNELS"
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE = _CSRC / "paged_attention_decode.cpp"
_HEADERS = [_CSRC / "cpu_vec.h"]  # torch only tracks `sources`: hashed into the name
# -fopenmp: at::parallel_for's OpenMP backend is inline in the torch headers, and
# `#pragma omp simd` marks the reductions vectorisable without -ffast-math.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG", "-w"]
_LDFLAGS = ["-fopenmp"]
_CACHE_OFF = ("", "off", "none", "0")

_lock = threading.Lock()
_op = None  # torch.ops.folio.paged_attention_decode once loaded
_tried = False
_failure: str | None = None
load_seconds: float | None = None  # how long the first build-or-load took


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _extension_name() -> str:
    digest = hashlib.sha256()
    parts = [_SOURCE.read_bytes(), *(h.read_bytes() for h in _HEADERS),
             " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
             platform.machine().encode(), _cpu_flags().encode()]
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return f"folio_paged_attention_decode_{digest.hexdigest()[:12]}"


def _build_directory(name: str) -> str | None:
    configured = os.environ.get("FOLIO_CACHE_DIR")
    if configured is None or configured.strip().lower() in _CACHE_OFF:
        return None  # torch's default root
    path = Path(configured).expanduser() / "torch_extensions" / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _load():
    from torch.utils import cpp_extension
    name = _extension_name()
    # torch logs its own notices (compiler checks) through this logger and `warnings`;
    # a failure is reported once, by the caller, so keep the build quiet.
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                               extra_ldflags=_LDFLAGS, build_directory=_build_directory(name),
                               is_python_module=False, verbose=False)
    finally:
        torch_log.setLevel(level)
    return torch.ops.folio.paged_attention_decode


def _short_reason(exc: BaseException, max_lines: int = 20, width: int = 160) -> str:
    """The exception's last lines, each cut short (compiler command lines are huge)."""
    lines = f"{type(exc).__name__}: {exc}".strip().splitlines()[-max_lines:]
    return "\n".join(line if len(line) <= width else line[:width] + " ..." for line in lines)


def _ensure():
    """The loaded operator, building it on the first call; None if that failed."""
    global _op, _tried, _failure, load_seconds
    if _op is not None or _tried:
        return _op
    with _lock:
        if not _tried:
            t0 = time.perf_counter()
            try:
                _op = _load()
            except Exception as exc:  # any failure means "use the reference"
                _failure = _short_reason(exc)
                log.warning("native CPU paged attention unavailable, using the torch "
                            "reference", reason=_failure)
            load_seconds = time.perf_counter() - t0
            _tried = True
    return _op


def is_available() -> bool:
    """Whether the native kernel can be used (builds it once, on the first call)."""
    if _disabled():
        return False
    return _ensure() is not None


def unavailable_reason() -> str | None:
    """Why the kernel is unavailable (None if it loaded, or was never tried)."""
    if _disabled():
        return f"{DISABLE_ENV} is set"
    return _failure


def paged_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query token per request over its paged keys and values.

    ``query`` ``[num_decodes, num_heads, head_dim]``; ``kv_cache`` contiguous
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` of the query's dtype
    (float32, bfloat16 or float16), already holding this step's keys and values;
    ``block_tables`` ``[num_decodes, max_blocks]`` int64 (other integer dtypes are
    converted, at the cost of a copy); ``seq_lens`` ``[num_decodes]`` int64, the keys
    each request attends to (its own token included). Query head ``h`` reads kv head
    ``h // (num_heads // num_kv_heads)``; with ``sliding_window`` W a request sees only
    positions ``>= seq_len - W``. Returns ``[num_decodes, num_heads, head_dim]`` in the
    query's dtype (float32 accumulation inside). A request with seq_len 0 gets zeros.
    """
    op = _op
    if op is None:
        op = None if _disabled() else _ensure()
        if op is None:
            raise RuntimeError(f"native CPU paged attention is unavailable: "
                               f"{unavailable_reason()}")
    if block_tables.dtype != torch.int64:
        block_tables = block_tables.to(torch.int64)
    if seq_lens.dtype != torch.int64:
        seq_lens = seq_lens.to(torch.int64)
    return op(query, kv_cache, block_tables, seq_lens, float(scale), sliding_window)
