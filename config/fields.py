"""What every config section is made of: documented fields and checked values."""
from __future__ import annotations

from dataclasses import field


def _f(default, doc: str, **kw):
    """A field with its one-line doc (``folio config`` prints it) and extra metadata."""
    return field(default=default, metadata={"doc": doc, **kw})


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key (and the file)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}", key)
