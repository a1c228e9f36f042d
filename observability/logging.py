"""structlog set-up: console or JSON lines, level from the YAML observability section."""
from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: str = "console") -> None:
    """Route structlog (and stdlib logging) to stderr in the chosen format."""
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=_LEVELS[level], stream=sys.stderr, format="%(message)s")


def get_logger(name: str | None = None):
    """A structlog logger bound to the module name."""
    return structlog.get_logger(name)
