"""structlog set-up: console or JSON lines, level from the YAML observability section,
and :class:`RateLimitedLog` for events a hostile client can repeat at will.

Without structlog installed (a bare GPU machine), loggers are stdlib ones taking the
same calls (observability/plain_logging.py), so nothing below the services needs it.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass, field

from observability import plain_logging

try:
    import structlog
except ImportError:  # the services need it; kernels and the worker do not
    structlog = None

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is written, not when logging was
    configured: a stream replaced since (a test's capture, closed when its test ended)
    must not take every later log call down with it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", fmt: str = "console") -> None:
    """Route structlog (and stdlib logging) to stderr in the chosen format."""
    if structlog is None:
        plain_logging.configure(_LEVELS[level], fmt)
        return
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # one write() per line (print() writes the line, then its newline): every
        # service of a stack shares one stderr, and a line must never be split by
        # another thread's or process's write (JSON logs are read line by line)
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=_LEVELS[level], stream=sys.stderr, format="%(message)s")


def get_logger(name: str | None = None):
    """A structlog logger bound to the module name (a stdlib one without structlog)."""
    if structlog is None:
        return plain_logging.PlainLogger(name)
    return structlog.get_logger(name)


@dataclass(slots=True)
class _Kind:
    message: str = ""
    fields: dict = field(default_factory=dict)
    num_pending: int = 0  # events not yet in a log line
    quiet_below: int = 0  # fewer events than this in an interval: a debug line
    next_at: float = 0.0  # monotonic time before which no line is written
    handle: asyncio.TimerHandle | None = None


class RateLimitedLog:
    """At most one warning line per event kind per ``interval_s``, none of them lost.

    The first event of a kind is logged at once. Later ones within the interval are
    only counted; one line at the interval's end reports them (``num_events``), so a
    flood costs one line per kind per interval. Without a running event loop the
    pending count waits for the kind's next event.
    """

    def __init__(self, logger, interval_s: float = 10.0):
        self._logger, self.interval_s = logger, interval_s
        self._kinds: dict[str, _Kind] = {}

    def event(self, kind: str, message: str, quiet_below: int = 0, **fields) -> None:
        """Count one event; an interval with fewer than ``quiet_below`` events of its
        kind is logged at debug level instead (routine events that only a flood of
        them makes worth a warning)."""
        state = self._kinds.setdefault(kind, _Kind())
        state.message, state.fields, state.quiet_below = message, fields, quiet_below
        state.num_pending += 1
        now = time.monotonic()
        if now >= state.next_at:
            self._flush(kind)
        elif state.handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            state.handle = loop.call_later(state.next_at - now, self._flush, kind)

    def _flush(self, kind: str) -> None:
        state = self._kinds[kind]
        if state.handle is not None:
            state.handle.cancel()
            state.handle = None
        if state.num_pending:
            emit = (self._logger.debug if state.num_pending < state.quiet_below
                    else self._logger.warning)
            emit(state.message, kind=kind, num_events=state.num_pending, **state.fields)
            state.num_pending = 0
            state.next_at = time.monotonic() + self.interval_s
