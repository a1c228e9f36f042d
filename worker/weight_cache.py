"""A disk cache of dequantised GGUF weights as safetensors, so the second start is fast.

Dequantising SmolLM2's Q4_1 GGUF with gguf.quants takes about 3 s on two cores; reading
the converted safetensors back takes a fraction of a second. Entries are keyed by the
source's resolved path, size, mtime and the target dtype, plus FORMAT_VERSION (bump it
whenever the conversion changes, so old entries are never read back).

Location: ``$FOLIO_CACHE_DIR`` if set (``off`` or empty disables the cache), else
``$XDG_CACHE_HOME/folio`` or ``~/.cache/folio``. Only the newest entry per (source,
dtype) is kept. A cache that cannot be written is skipped with a warning, never fatal.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from observability.logging import get_logger

log = get_logger(__name__)

FORMAT_VERSION = 1
CACHE_DIR_ENV = "FOLIO_CACHE_DIR"
_DISABLED_VALUES = ("", "off", "none", "0")


class WeightCache:
    """Converted state dicts on disk, one safetensors file per (source file, dtype)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    @classmethod
    def from_env(cls) -> "WeightCache | None":
        """The cache at the configured location, or None when it is switched off."""
        configured = os.environ.get(CACHE_DIR_ENV)
        if configured is not None:
            if configured.strip().lower() in _DISABLED_VALUES:
                return None
            return cls(Path(configured).expanduser())
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return cls(Path(base) / "folio")

    def entry_path(self, source: Path, dtype: torch.dtype) -> Path:
        """Where the entry for this version of ``source`` converted to ``dtype`` lives."""
        return self.directory / f"{self._family(source, dtype)}-{self._version(source)}.safetensors"

    def load(self, source: Path, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """The cached state dict, or None on a miss or an unreadable entry."""
        entry = self.entry_path(source, dtype)
        if not entry.is_file():
            return None
        try:
            return load_file(entry)
        except Exception as exc:  # a torn or corrupt entry is a miss, and is removed
            log.warning("unreadable weight cache entry discarded", entry=str(entry), reason=str(exc))
            entry.unlink(missing_ok=True)
            return None

    def store(self, source: Path, dtype: torch.dtype, state_dict: dict[str, torch.Tensor]) -> None:
        """Write the entry atomically (temp file + rename) and drop stale siblings."""
        entry = self.entry_path(source, dtype)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, temp_name = tempfile.mkstemp(dir=self.directory, suffix=".partial")
            os.close(handle)
            try:
                save_file(state_dict, temp_name, metadata={"source": str(source)})
                os.replace(temp_name, entry)
            finally:
                Path(temp_name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("weight cache not written", directory=str(self.directory), reason=str(exc))
            return
        for sibling in self.directory.glob(f"{self._family(source, dtype)}-*.safetensors"):
            if sibling != entry:
                sibling.unlink(missing_ok=True)

    @staticmethod
    def _family(source: Path, dtype: torch.dtype) -> str:
        # All versions of one source file in one dtype share this prefix.
        key = f"{source.resolve()}|{dtype}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    @staticmethod
    def _version(source: Path) -> str:
        stat = source.stat()
        key = f"{stat.st_size}|{stat.st_mtime_ns}|{FORMAT_VERSION}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]
