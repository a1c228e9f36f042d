"""The fields of a body that constrain its output, read into one value.

    response_format   {"type": "text"} | {"type": "json_object"} |
                      {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs  vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object"}
    guided_json, guided_regex, guided_choice, guided_grammar   (vLLM's older flat fields)
    tools + tool_choice (+ parallel_tool_calls)   chat only (tool_calls.py)

At most one of them may constrain a request. Each is checked for shape and size here
(a 400 naming the field); whether its grammar compiles is checked next, on the grammar
thread (grammar_check.py), still before anything reaches the engine. A JSON schema
from ``response_format`` is enforced leniently unless ``strict`` is true (then a
keyword the grammar cannot enforce is a 400); the other fields are always strict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_core.structured_outputs import StructuredOutputError, StructuredOutputsParams
from services.api.openai_protocol import bad
from services.api.tool_calls import ToolCallFormat, tool_call_format

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredRequest:
    """What a request's output must match, and which body field asked for it."""

    params: StructuredOutputsParams
    param: str  # the field named by its errors
    tools: ToolCallFormat | None = None  # set when the output is a tool call


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except StructuredOutputError as e:
        raise bad(f"'{param}': {e}", param) from None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind != "json_schema":
        raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": "
                  "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {...}}",
                  "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad("'response_format.json_schema' must be an object with a 'schema' object",
                  "response_format")
    if not isinstance(spec.get("name", ""), str) or not isinstance(
            spec.get("strict") or False, bool):
        raise bad("'response_format.json_schema': 'name' must be a string and 'strict' a "
                  "boolean", "response_format")
    return _params("response_format", json=spec["schema"], strict=spec.get("strict") is True)


def _vllm_fields(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad("'structured_outputs' must be an object", "structured_outputs")
    unknown = sorted(k for k, v in value.items() if k not in _VLLM_KEYS and v is not None)
    if unknown:
        raise bad(f"'structured_outputs.{unknown[0][:40]}' is not supported (only "
                  f"{', '.join(_VLLM_KEYS)})", "structured_outputs")
    return _params("structured_outputs", **{k: value[k] for k in _VLLM_KEYS if k in value})


def structured_request(body: dict, *, chat: bool, max_chars: int) -> StructuredRequest | None:
    """The request's constraint (see the module docstring), or None if its output is
    free; ``max_chars`` bounds the grammar's text."""
    found: list[StructuredRequest] = []
    if body.get("response_format") is not None:
        params = _response_format(body["response_format"])
        if params is not None:
            found.append(StructuredRequest(params, "response_format"))
    if body.get("structured_outputs") is not None:
        found.append(StructuredRequest(_vllm_fields(body["structured_outputs"]),
                                       "structured_outputs"))
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append(StructuredRequest(_params(key, **{kind: body[key]}), key))
    tools = _tools(body, chat)
    if tools is not None:
        found.append(tools)
    if len(found) > 1:
        raise bad(f"'{found[1].param}' cannot be combined with '{found[0].param}': one "
                  f"constraint per request", found[1].param)
    if not found:
        return None
    request = found[0]
    size = len(request.params.spec.text)
    if size > max_chars:
        raise bad(f"'{request.param}' makes a grammar of {size} characters; at most "
                  f"{max_chars} are allowed", request.param)
    return request


def _tools(body: dict, chat: bool) -> StructuredRequest | None:
    if not chat:  # completions have no tools; their defaults stay accepted
        tools, choice = body.get("tools"), body.get("tool_choice")
        if tools is not None and not (isinstance(tools, list) and not tools):
            raise bad("'tools' is only served on chat completions", "tools")
        if choice is not None and choice not in ("none", "auto"):
            raise bad("'tool_choice' is only served on chat completions", "tool_choice")
        return None
    made = tool_call_format(body)
    if made is None:
        return None
    fmt, params = made
    return StructuredRequest(params, "tools", fmt)
