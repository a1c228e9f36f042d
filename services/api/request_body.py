"""Reading a request body into a JSON object, never trusting its size or its bytes.

The body is read only after its declared size passed (413 before a byte is read) and
the process's body budget took it (503, body_budget.py), and never past
``max_body_bytes`` even without a Content-Length (chunked uploads). Then it must be
UTF-8 JSON whose top level is an object. ``NaN`` and ``Infinity`` parse to non-finite
floats on purpose, so the field check that meets one names its ``param``; strings
holding lone surrogates (``"\\ud800"``, valid JSON but not text) are refused with the
top-level field that holds them, before a tokenizer could choke on them. A key twice in
one object, at any depth, is refused naming it: JSON leaves its meaning open and
parsers disagree on which value wins, so a proxy and Folio could read two requests.

The parser itself is bounded too: ``json.loads`` holds the GIL and the event loop for
its whole run (4 MiB of ``1,1,1,...`` took 166 ms here), so a body holding more than
``api.max_json_values`` values (lists' items, objects' members) is refused before it is
parsed. Counting commas outside strings bounds that number; the count skips the string
scan when even the commas anywhere stay within the bound, as in every ordinary body.
"""
from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from services.api.body_budget import BodyReservation
from services.api.openai_protocol import APIError, bad


def too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds {max_body_bytes} bytes",
                    param=None, code="request_too_large")


def check_declared_size(request: web.BaseRequest, max_body_bytes: int) -> None:
    """413 at once when the Content-Length already says the body is too large."""
    length = request.content_length  # aiohttp's parser refused negative or bad values
    if length is not None and length > max_body_bytes:
        raise too_large(max_body_bytes)


async def read_body(request: web.BaseRequest, max_body_bytes: int,
                    reservation: BodyReservation) -> bytes:
    """The raw body, read in chunks and abandoned as soon as it passes the limit; every
    byte is held in ``reservation`` before it is read (the declared length at once)."""
    check_declared_size(request, max_body_bytes)
    reservation.hold(request.content_length or 0)
    chunks, size = [], 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large(max_body_bytes)
        reservation.hold(size)  # a chunked body grows its share as it arrives
        chunks.append(chunk)


# A lone surrogate can only come from an escape (decoded UTF-8 never holds one); a
# body without any such escape skips the walk over every string it holds, which for
# a body of two million list items would cost the event loop most of a second.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


# One JSON string, escapes included (the unrolled form: runs of plain characters are
# consumed in one step, so a 4 MB prompt costs one match, not four million).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


# Up to this many quote characters the commas inside strings are counted string by
# string (4 MB of stop_token_ids: 1.5 ms against 5-9 ms for copying the text without
# its strings); past it, a Python loop over the strings would cost more than the copy.
FEW_QUOTES = 4096


def check_value_count(text: str, max_values: int) -> None:
    """400 when the JSON text holds more than about ``max_values`` values."""
    num_commas = text.count(",")
    if num_commas < max_values:
        return
    if text.count('"') <= FEW_QUOTES:
        outside = num_commas - sum(m.group().count(",") for m in _JSON_STRING.finditer(text))
    else:
        outside = _JSON_STRING.sub("", text).count(",")
    if outside >= max_values:
        raise bad(f"the body holds more than {max_values} JSON values (api.max_json_values)")


def _non_finite(name: str) -> float:
    return float(name.replace("Infinity", "inf"))  # "NaN", "Infinity", "-Infinity"


def parse_json_object(raw: bytes, max_values: int | None = None) -> dict[str, Any]:
    """The body as a dict; 400 for bad UTF-8, bad JSON, a non-object, bad strings, or
    more than ``max_values`` values."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the body is not valid UTF-8") from None
    if max_values is not None:
        check_value_count(text, max_values)
    try:
        body = json.loads(text, parse_constant=_non_finite, object_pairs_hook=_object)
    except RecursionError:
        raise bad("the body is nested too deeply") from None
    except ValueError:  # JSONDecodeError, or an integer with too many digits
        raise bad("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    if not _SURROGATE_ESCAPE.search(text):
        return body  # valid UTF-8 holds no surrogates: only a \uD800-\uDFFF escape can
    for key, value in body.items():
        if not _is_text(key) or not _all_text(value):
            raise bad("strings must be valid Unicode (no lone surrogates)",
                      key if _is_text(key) else None)
    return body


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object; 400 naming the first key that appears twice in it."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                # json.dumps: an ASCII-safe quote, even of a lone surrogate
                raise bad(f"duplicate key {json.dumps(key[:100])} in a JSON object",
                          key if _is_text(key) else None)
            seen.add(key)
    return obj


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
