"""Stdlib logging behind structlog's calling convention, for machines without structlog.

``log.info("event", key=value)`` works either way. A bare GPU machine with no network
has no structlog; the kernels and the worker still log there, as ``event key=value``
lines (or one JSON object per line) through the standard library.
"""
from __future__ import annotations

import json
import logging
import sys

_format = {"json": False}  # set by configure(); read on every call


class PlainLogger:
    """A stdlib logger that takes structlog-style calls: an event plus keyword fields."""

    def __init__(self, name: str | None, fields: dict | None = None):
        self._logger = logging.getLogger(name)
        self._fields = fields or {}

    def bind(self, **fields) -> "PlainLogger":
        return PlainLogger(self._logger.name, {**self._fields, **fields})

    def _log(self, level: int, event: str, fields: dict, exc_info: bool = False) -> None:
        if not self._logger.isEnabledFor(level):
            return
        fields = {**self._fields, **fields}
        if _format["json"]:
            line = json.dumps({"event": event, "level": logging.getLevelName(level).lower(),
                               "logger": self._logger.name, **fields}, default=str)
        else:
            line = " ".join([event, *(f"{k}={v!r}" for k, v in fields.items())])
        self._logger.log(level, line, exc_info=exc_info)

    def debug(self, event: str, **fields) -> None:
        self._log(logging.DEBUG, event, fields)

    def info(self, event: str, **fields) -> None:
        self._log(logging.INFO, event, fields)

    def warning(self, event: str, **fields) -> None:
        self._log(logging.WARNING, event, fields)

    def error(self, event: str, **fields) -> None:
        self._log(logging.ERROR, event, fields)

    def exception(self, event: str, **fields) -> None:
        self._log(logging.ERROR, event, fields, exc_info=True)


def configure(level: int, fmt: str) -> None:
    """Send the root logger's records to stderr at ``level``, as console text or JSON."""
    _format["json"] = fmt == "json"
    text = "%(message)s" if fmt == "json" else "%(asctime)s [%(levelname)s] %(name)s: %(message)s"
    logging.basicConfig(level=level, stream=sys.stderr, format=text, force=True)
