"""Reading a request body into a JSON object, never trusting its size or its bytes.

The body is read only after its declared size passed (413 before a byte is read) and
never past ``max_body_bytes`` even without a Content-Length (chunked uploads). Then it
must be UTF-8 JSON whose top level is an object. ``NaN`` and ``Infinity`` parse to
non-finite floats on purpose, so the field check that meets one names its ``param``;
strings holding lone surrogates (``"\\ud800"``, valid JSON but not text) are refused
with the top-level field that holds them, before a tokenizer could choke on them.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from services.api.openai_protocol import APIError, bad


def too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds {max_body_bytes} bytes",
                    param=None, code="request_too_large")


def check_declared_size(request: web.BaseRequest, max_body_bytes: int) -> None:
    """413 at once when the Content-Length already says the body is too large."""
    length = request.content_length  # aiohttp's parser refused negative or bad values
    if length is not None and length > max_body_bytes:
        raise too_large(max_body_bytes)


async def read_body(request: web.BaseRequest, max_body_bytes: int) -> bytes:
    """The raw body, read in chunks and abandoned as soon as it passes the limit."""
    check_declared_size(request, max_body_bytes)
    chunks, size = [], 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large(max_body_bytes)
        chunks.append(chunk)


def _non_finite(name: str) -> float:
    return float(name.replace("Infinity", "inf"))  # "NaN", "Infinity", "-Infinity"


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict; 400 for bad UTF-8, bad JSON, a non-object or bad strings."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the body is not valid UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_non_finite)
    except RecursionError:
        raise bad("the body is nested too deeply") from None
    except ValueError:  # JSONDecodeError, or an integer with too many digits
        raise bad("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    for key, value in body.items():
        if not _is_text(key) or not _all_text(value):
            raise bad("strings must be valid Unicode (no lone surrogates)",
                      key if _is_text(key) else None)
    return body


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _all_text(value: Any) -> bool:
    """Whether every string (key or value) inside ``value`` encodes as UTF-8.

    Iterative: a body nested as deeply as the JSON parser allows cannot overflow it.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return False
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return True
