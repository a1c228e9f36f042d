"""A model's Jinja chat template, compiled once and rendered in a sandbox.

Templates come with model files, i.e. from strangers, so they run in Jinja's immutable
sandbox (no attribute access to Python internals, no mutation of the passed messages).
The environment mirrors what Hugging Face templates are written against: trim_blocks and
lstrip_blocks on, loop controls, ``raise_exception(msg)``, ``strftime_now(fmt)`` and a
``tojson`` that keeps non-ASCII text readable.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


# A role (and OpenAI's optional ``name``) is an identifier: templates paste it between
# their own markers, so a newline or "<|im_end|>" in it would forge a turn. Custom
# roles stay allowed, as in vLLM.
_IDENTIFIER = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ChatTemplateError(ValueError):
    """The messages are malformed, or the template refused or failed to render them."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _text_content(content: Any, index: int) -> str:
    """A message's content as a string; OpenAI-style lists of text parts are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ChatTemplateError(f"messages[{index}].content: only text parts "
                                        f"({{'type': 'text', 'text': ...}}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text "
                            f"parts, got {type(content).__name__}")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation's shape and return copies with string contents.

    Each message is a dict with a ``role`` of 1-64 ASCII letters, digits, ``_`` or ``-``
    and a ``content`` that is a string or a list of text parts; ``content`` may be null
    only on an assistant message that carries ``tool_calls``. A ``name`` follows the
    role's rule; other keys (tool_calls, tool_call_id) pass through.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be an object with 'role' and "
                                    f"'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not _IDENTIFIER.fullmatch(role):
            raise ChatTemplateError(f"messages[{index}].role must be 1-64 letters, digits, "
                                    f"'_' or '-'")
        name = message.get("name")
        if name is not None and not (isinstance(name, str) and _IDENTIFIER.fullmatch(name)):
            raise ChatTemplateError(f"messages[{index}].name must be 1-64 letters, digits, "
                                    f"'_' or '-'")
        content = message.get("content")
        calls_tools = role == "assistant" and bool(message.get("tool_calls"))
        if "content" not in message and not calls_tools:
            raise ChatTemplateError(f"messages[{index}] has no 'content'")
        if content is None and not calls_tools:
            raise ChatTemplateError(f"messages[{index}].content is null; only an assistant "
                                    f"message with tool_calls may omit its content")
        copy = dict(message)
        copy["content"] = "" if content is None else _text_content(content, index)
        checked.append(copy)
    return checked


def inline_tool_calls(messages: list[Any]) -> list[Any]:
    """Assistant messages whose ``tool_calls`` a template would drop, with the calls
    written as their content: the JSON array ``[{"name", "arguments"}]`` that a
    "required" tool choice makes the model produce, so the model sees its own calls.
    Only messages without content change; anything malformed is left to validation."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and calls and not message.get("content"):
            message = {**message, "content": json.dumps([_call_json(c) for c in calls],
                                                        ensure_ascii=False)}
        out.append(message)
    return out


def _call_json(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": arguments}


class ChatTemplate:
    """One compiled chat template; :meth:`render` turns a conversation into prompt text."""

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    def render(self, messages: Any, *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, bos_token: str | None = None,
               eos_token: str | None = None, **template_kwargs: Any) -> str:
        """Render validated ``messages``; ``template_kwargs`` become extra template variables."""
        checked = validate_messages(messages)
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise ChatTemplateError("tools must be a list of objects")
        try:
            return self._template.render(
                messages=checked, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=bos_token or "", eos_token=eos_token or "", **template_kwargs)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template bug (TypeError, sandbox SecurityError, ...)
            raise ChatTemplateError(f"chat template failed to render: "
                                    f"{type(exc).__name__}: {exc}") from exc
