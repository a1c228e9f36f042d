"""OpenAI's error shape: every error over HTTP is ``{"error": {message, type, param,
code}}``. Request bodies are checked in request_body.py and request_validation.py.

Messages never echo large inputs back, never hold a file path or a traceback, and are
cut at 1000 characters, so an error body stays small whatever the request held.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class APIError(Exception):
    """An error the client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: Mapping[str, str] | None = None  # extra response headers (Retry-After, ...)

    def body(self) -> dict:
        param = self.param[:100] if self.param is not None else None  # may be a body key
        return {"error": {"message": self.message[:1000], "type": self.type,
                          "param": param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str, code: str = "engine_unavailable") -> APIError:
    """503: the engine is gone or this process is draining; retrying later may work."""
    return APIError(503, message, "service_unavailable", code=code)
