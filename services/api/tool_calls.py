"""Function calling: ``tools`` + ``tool_choice`` become a grammar, and outputs become
OpenAI's ``tool_calls``.

    tool_choice {"type": "function", "function": {"name": N}}
        the output is N's arguments: a JSON object valid under N's ``parameters``
    tool_choice "required"
        the output is a JSON array of 1+ calls (exactly 1 with parallel_tool_calls
        false): [{"name": one of the tools, "arguments": valid under its parameters}]
    tool_choice "none"   the tools are ignored (not constrained, not rendered)
    tool_choice "auto"   (the default with tools) needs a chat template that defines a
        tool-call format this server can read in free text; no such parser exists yet
        (SmolLM2's ChatML template defines none), so it is refused with a 400

Streaming: a named call streams its arguments as they are generated (the first chunk
carries the call's id and name); "required" calls are sent when the sample ends, each
whole, since only then is the array known to be complete.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from engine_core.structured_outputs import StructuredOutputsParams
from services.api.openai_protocol import bad

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How a tool-call output is read back: ``named`` is the function whose arguments
    the output is, or None for a "required" array of calls."""

    named: str | None = None


def check_tools(value: Any) -> None:
    """400 naming ``tools`` unless ``value`` is a valid list of function tools."""
    _tools(value)


def _tools(value: Any) -> dict[str, tuple[dict, bool]]:
    """name -> (parameters schema, strict) of each function in ``tools``."""
    if not isinstance(value, list):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}",
                  "tools")
    if len(value) > MAX_TOOLS:
        raise bad(f"'tools' may hold at most {MAX_TOOLS} functions", "tools")
    functions: dict[str, tuple[dict, bool]] = {}
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(function, dict)):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                      "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'",
                      "tools")
        if name in functions:
            raise bad(f"tools[{i}]: the function name {name!r} is used twice", "tools")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if not isinstance(function.get("description", ""), str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        functions[name] = (parameters, function.get("strict") is True)
    return functions


def _choice(value: Any, functions: dict) -> str | None:
    """"none", "auto", "required", or the named function's name."""
    if value in ("none", "auto", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                  "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if function["name"] not in functions:
        raise bad(f"'tool_choice' names {function['name'][:64]!r}, which is not in "
                  f"'tools'", "tool_choice")
    return function["name"]


def tool_call_format(body: dict) -> tuple[ToolCallFormat, StructuredOutputsParams] | None:
    """The format and grammar ``tools``/``tool_choice`` ask for; None when the output
    is free (no tools, or tool_choice "none"). 400 naming the field otherwise."""
    functions = _tools(body["tools"]) if body.get("tools") is not None else {}
    raw_choice = body.get("tool_choice")
    choice = _choice(raw_choice, functions) if raw_choice is not None else (
        "auto" if functions else "none")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice == "none":
        return None
    if not functions:
        raise bad(f"tool_choice {choice!r} needs a non-empty 'tools'", "tool_choice")
    if choice == "auto":
        raise bad("tool_choice \"auto\" needs a parser for tool calls written in free "
                  "text in the format the model's chat template defines, and this server "
                  "has none for this model; use tool_choice \"required\" or name a "
                  "function", "tool_choice")
    if choice != "required":
        parameters, strict = functions[choice]
        return ToolCallFormat(choice), StructuredOutputsParams(json=parameters, strict=strict)
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
         "required": ["name", "arguments"], "additionalProperties": False}
        for name, (parameters, _) in functions.items()]}}
    if parallel is False:
        calls["maxItems"] = 1
    strict = all(s for _, s in functions.values())
    return ToolCallFormat(), StructuredOutputsParams(json=calls, strict=strict)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(name: str, arguments: str, index: int | None = None) -> dict:
    call = {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> list[dict] | None:
    """OpenAI ``tool_calls`` from a finished output; None if it is not a complete call
    (the output was cut by max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if fmt.named is not None:
        return [_call(fmt.named, text)] if isinstance(value, dict) else None
    if not (isinstance(value, list) and value and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in value)):
        return None
    return [_call(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False))
            for c in value]


def tool_call_message(text: str, finish_reason: str | None,
                      fmt: ToolCallFormat) -> tuple[dict, str | None]:
    """The assistant message and finish reason of one finished sample."""
    calls = parse_tool_calls(text, fmt) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


class ToolCallStream:
    """One sample's stream of ``delta`` bodies (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self._text = ""
        self._opened = False

    def deltas(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The delta bodies for one piece of output text, and the finish reason to send
        with the last of them (None while the sample runs)."""
        self._text += text
        out: list[dict] = []
        if self.fmt.named is not None:
            if not self._opened:
                self._opened = True
                out.append({"tool_calls": [_call(self.fmt.named, "", 0)]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            if finish_reason is None:
                return out, None
            complete = finish_reason == "stop" and _is_object(self._text)
            return out, "tool_calls" if complete else finish_reason
        if finish_reason is None:
            return out, None
        _, finish = tool_call_message(self._text, finish_reason, self.fmt)
        if finish != "tool_calls":
            return [{"content": self._text}], finish
        calls = parse_tool_calls(self._text, self.fmt) or []
        return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)], finish


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
