"""What every config section is built from: documented fields and checked values.

Each field's ``metadata["doc"]`` is its one-line description; the loader uses it for
error messages and ``folio config`` prints it.
"""
from __future__ import annotations

from dataclasses import field


def _f(default, doc: str, **kw):
    return field(default=default, metadata={"doc": doc, **kw})


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key (and the file)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}", key)
