"""How one body field is read: its JSON type, its range, and the fields Folio refuses.

Types are strict: a bool is not an integer, and a refused field's default must be
spelled with the default's own type (Python's ``==`` says ``0 == False`` and
``1.0 == True == 1``; JSON does not). A range error names the bound that was crossed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.api.openai_protocol import bad

INT64_MAX = 2 ** 63 - 1
INT64_MIN = -INT64_MAX - 1
NUMBER = (int, float)
_BOUND_NAMES = {INT64_MAX: "2^63-1", INT64_MIN: "-2^63"}

# Fields OpenAI defines that Folio does not serve: absent, null or one of these values
# (same type, same value) is accepted; anything else asks for something not served.
# (response_format, tools and tool_choice are served: services/api/structured_request.py)
REFUSED: dict[str, tuple] = {
    "suffix": ("",), "best_of": (1,), "cache_salt": ()}


@dataclass(frozen=True, slots=True)
class Range:
    """Inclusive bounds (None: unbounded), or an exclusive lower one (``lo_open``)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def violation(self, key: str, value: float) -> str | None:
        """The error for ``value``, naming the bound it crosses; None when inside."""
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            relation = "greater than" if self.lo_open else "at least"
            return f"'{key}' must be {relation} {_spell(self.lo)}"
        if self.hi is not None and value > self.hi:
            return f"'{key}' must be at most {_spell(self.hi)}"
        return None


INT64 = Range(INT64_MIN, INT64_MAX)


def _spell(bound: float) -> str:
    name = _BOUND_NAMES.get(bound) if isinstance(bound, int) else None
    return f"{bound} ({name})" if name else str(bound)


def _type_name(types: tuple) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object"}[types[-1] if types == NUMBER else types[0]]


def typed(body: dict, key: str, types: tuple, bounds: Range | None = None) -> Any:
    """``body[key]`` if it has one of ``types`` (bool is never a number) and lies in
    ``bounds``; else a 400 naming ``key``.

    An integer field takes a whole-number float (``"seed": 26915506.0``) as that
    integer, as vLLM does (JSON has one number type; many clients write every number
    as a float); ``2.5`` stays a 400."""
    value = body[key]
    if (types == (int,) and isinstance(value, float) and math.isfinite(value)
            and value.is_integer()):
        value = int(value)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        name = _type_name(types)
        raise bad(f"'{key}' must be a{'n' if name[0] in 'aeiou' else ''} {name}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"'{key}' must be a finite number", key)
    error = bounds.violation(key, value) if bounds is not None else None
    if error is not None:
        raise bad(error, key)
    return value


def chat_prompt_flags(body: dict) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat or chat-tokenize body.

    ``continue_final_message`` leaves the final message open for the model to go on
    with, so it excludes a new generation prompt: both true is a 400 naming
    ``continue_final_message``, as in vLLM. Unlike vLLM, an absent
    ``add_generation_prompt`` defaults to the opposite of ``continue_final_message``
    (vLLM's clients send both, so they see no difference)."""
    cont = (typed(body, "continue_final_message", (bool,))
            if body.get("continue_final_message") is not None else False)
    add = (typed(body, "add_generation_prompt", (bool,))
           if body.get("add_generation_prompt") is not None else not cont)
    if add and cont:
        raise bad("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                  "continue_final_message")
    return add, cont


def _same(a: Any, b: Any) -> bool:
    """JSON equality: equal values of the same types, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def check_refused(body: dict) -> None:
    """400 naming the first refused field (see ``REFUSED``) set to something served."""
    for key, defaults in REFUSED.items():
        value = body.get(key)
        if value is not None and not any(_same(value, d) for d in defaults):
            raise bad(f"'{key}' is not supported by this server", key)


def token_ids(value: Any, key: str, vocab_size: int,
              max_count: int | None = None) -> list[int]:
    """``value`` as token ids: a list of at most ``max_count`` integers in
    [0, vocab_size), checked in one pass after its length; else a 400 naming ``key``."""
    if not isinstance(value, list):
        raise bad(f"'{key}' must be a list of token ids", key)
    if max_count is not None and len(value) > max_count:
        raise bad(f"'{key}' may hold at most {max_count} token ids", key)
    for t in value:
        if type(t) is not int:  # JSON integers only: not bool, not float
            raise bad(f"'{key}' must be a list of token ids", key)
        if not 0 <= t < vocab_size:
            raise bad(f"'{key}' holds token ids outside the vocabulary [0, {vocab_size})",
                      key)
    return value
