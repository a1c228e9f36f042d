"""The native CPU kernels, compiled at first use into one extension.

``csrc/*.cpp`` (decode paged attention, 16-bit linear layers, fused RMSNorm, linear layers
on block-quantized weights, LoRA for decode-sized steps, the fused decode layers, the
sampler's row argmax) are built with
``torch.utils.cpp_extension.load`` the first time :func:`ensure` (or a wrapper's
``is_available``) runs, then loaded from the build folder on later starts (a warm load
takes well under a second; a cold build a minute or so). Each source registers its
operators under ``torch.ops.folio``.

Build folder: ``$FOLIO_CACHE_DIR/torch_extensions/<name>`` when ``FOLIO_CACHE_DIR`` is
set to a directory, else torch's default (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``). ``<name>`` hashes the sources, the flags, the torch
version, the CPU's feature flags and the sources' folder: the build uses
``-march=native``, so a cache shared between different CPUs must never hand one machine
another's binary, and two checkouts must not take turns rebuilding one folder.

Builders never wait on a dead one: torch guards a build with a ``lock`` file that stays
behind when its process is killed mid-compile, and every later build would wait on it for
ever. So each build holds an ``fcntl`` lock on ``<build folder>/folio.flock`` (released by
the kernel when its holder dies, however it dies); a torch ``lock`` file found while
holding it belongs to no live Folio builder and is removed.

``FOLIO_DISABLE_CPU_KERNELS=1`` switches the kernels off (``is_available()`` is False
and nothing is built, unless it was already loaded). Any build or load failure is logged
once, as a warning with its reason, and ``is_available()`` stays False for the life of
the process, so callers fall back to torch.

Threads: the kernels split work with ``at::parallel_for``, i.e. torch's own OpenMP pool
(``torch.set_num_threads`` applies); they link the libgomp torch already loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from observability.logging import get_logger

log = get_logger(__name__)

DISABLE_ENV = "FOLIO_DISABLE_CPU_KERNELS"
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "paged_attention_decode.cpp", _CSRC / "half_linear.cpp",
            _CSRC / "rms_norm.cpp", _CSRC / "quant_linear.cpp", _CSRC / "lora_decode.cpp",
            _CSRC / "decode_layer.cpp", _CSRC / "row_argmax.cpp",
            _CSRC / "silu_and_mul.cpp", _CSRC / "rotary_embedding.cpp",
            _CSRC / "prefill_attention.cpp", _CSRC / "amx_linear.cpp"]
# torch only tracks `sources`: headers are hashed into the name
_HEADERS = [_CSRC / "amx.h", _CSRC / "cpu_vec.h", _CSRC / "quant_pack.h", _CSRC / "quant_tiles.h",
            _CSRC / "kernel_entries.h", _CSRC / "scratch.h", _CSRC / "rotary.h"]
# -fopenmp: at::parallel_for's OpenMP backend is inline in the torch headers, and
# `#pragma omp simd` marks the reductions vectorisable without -ffast-math.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG", "-w"]
_LDFLAGS = ["-fopenmp"]
_CACHE_OFF = ("", "off", "none", "0")

_lock = threading.Lock()
_ops = None  # torch.ops.folio once loaded
_tried = False
_failure: str | None = None
load_seconds: float | None = None  # how long the first build-or-load took


def _disabled() -> bool:
    value = os.environ.get(DISABLE_ENV)  # read per call: tests and operators flip it
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")


def cpu_flags() -> str:
    """The CPU's feature flags line (a build for one set must not run on another)."""
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
    parts = [*(s.read_bytes() for s in _SOURCES), *(h.read_bytes() for h in _HEADERS),
             " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
             platform.machine().encode(), cpu_flags().encode(),
             # torch's build.ninja names the sources by path: two checkouts with equal
             # sources sharing one folder would rewrite it and rebuild in turn for ever
             str(_CSRC).encode()]
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return f"folio_cpu_kernels_{digest.hexdigest()[:12]}"


def build_id() -> str:
    """Names this build: sources, flags, torch version and CPU features hashed."""
    return _extension_name()


def _torch_default_root() -> Path:
    """Where torch would build (its own rule: $TORCH_EXTENSIONS_DIR, else the user cache)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    major, minor = sys.version_info[:2]
    variant = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    return Path(cache) / "torch_extensions" / f"py{major}{minor}_{variant}"


def build_root() -> Path:
    """The folder that holds the extension's build folders (see the module docstring)."""
    configured = os.environ.get("FOLIO_CACHE_DIR")
    if configured is None or configured.strip().lower() in _CACHE_OFF:
        return _torch_default_root()
    return Path(configured).expanduser() / "torch_extensions"


def _build_directory(name: str) -> Path:
    path = build_root() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def build_guard(build_directory: Path):
    """Hold the folder's builder lock; drop torch's ``lock`` file if a dead builder left it.

    Waits while another live process builds (its compile takes a minute or so)."""
    with open(build_directory / "folio.flock", "a+") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            baton = build_directory / "lock"
            if baton.exists():  # no live Folio builder holds it: ours is the only flock
                log.warning("removing a build lock left by a killed build",
                            path=str(baton))
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _load():
    from torch.utils import cpp_extension
    name = _extension_name()
    # torch logs its own notices (compiler checks) through this logger and `warnings`;
    # a failure is reported once, by the caller, so keep the build quiet.
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    build_directory = _build_directory(name)
    try:
        with warnings.catch_warnings(), build_guard(build_directory):
            warnings.simplefilter("ignore")
            cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES],
                               extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                               build_directory=str(build_directory),
                               is_python_module=False, verbose=False)
    finally:
        torch_log.setLevel(level)
    return torch.ops.folio


def _short_reason(exc: BaseException, max_lines: int = 20, width: int = 160) -> str:
    """The exception's last lines, each cut short (compiler command lines are huge)."""
    lines = f"{type(exc).__name__}: {exc}".strip().splitlines()[-max_lines:]
    return "\n".join(line if len(line) <= width else line[:width] + " ..." for line in lines)


def ensure():
    """``torch.ops.folio`` with the kernels loaded, building them on the first call;
    None if that failed or the kernels are switched off."""
    global _ops, _tried, _failure, load_seconds
    if _ops is not None:
        return _ops
    if _tried or _disabled():
        return None
    with _lock:
        if not _tried:
            t0 = time.perf_counter()
            try:
                _ops = _load()
            except Exception as exc:  # any failure means "use torch instead"
                _failure = _short_reason(exc)
                log.warning("native CPU kernels unavailable, using the torch reference",
                            reason=_failure)
            load_seconds = time.perf_counter() - t0
            _tried = True
    return _ops


def is_available() -> bool:
    """Whether the native kernels can be used (builds them once, on the first call).

    False while ``FOLIO_DISABLE_CPU_KERNELS`` is set, even once loaded: callers pick
    torch then; a direct operator call still runs a loaded kernel."""
    return not _disabled() and ensure() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are unavailable (None if they loaded, or were never tried)."""
    if _disabled():
        return f"{DISABLE_ENV} is set"
    return _failure


def require():
    """``torch.ops.folio`` for a direct kernel call; raises if the kernels are not there."""
    ops = ensure()
    if ops is None:
        raise RuntimeError(f"native CPU kernels are unavailable: {unavailable_reason()}")
    return ops
