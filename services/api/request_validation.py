"""Every field of an OpenAI completion or chat body, checked before any tokenization.

The first field that is wrong becomes one 400 whose ``param`` names it, so an error
body stays small however many fields are wrong. Integers are bounded so they fit the
engine's int64 wire format and tensors; a prompt's length against ``max_model_len`` is
checked again after tokenization (:meth:`RequestValidator.check_prompt_ids`).

Fields OpenAI defines that Folio does not serve (``echo``, ``suffix``, ``logit_bias``,
``tools``...) are refused when set rather than silently ignored; other unknown fields
are ignored, as vLLM does. ``cache_salt`` is refused: the server derives it from the
caller's API key (services/api/auth.py) and never takes it from a client.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine_core.sampling_params import InvalidRequestError, SamplingParams
from text.chat_template import ChatTemplateError, validate_messages
from services.api.openai_protocol import APIError, bad

INT64_MAX = 2 ** 63 - 1
_NUMBER = (int, float)
# field → (accepted types, inclusive bounds or None); SamplingParams re-checks the rest
_FIELDS: dict[str, tuple[tuple, tuple | None]] = {
    "temperature": (_NUMBER, (0.0, 2.0)), "top_p": (_NUMBER, (0.0, 1.0)),
    "min_p": (_NUMBER, (0.0, 1.0)), "seed": ((int,), (-INT64_MAX - 1, INT64_MAX)),
    "presence_penalty": (_NUMBER, (-2.0, 2.0)), "frequency_penalty": (_NUMBER, (-2.0, 2.0)),
    "repetition_penalty": (_NUMBER, None), "priority": ((int,), (-INT64_MAX - 1, INT64_MAX)),
    "ignore_eos": ((bool,), None), "skip_special_tokens": ((bool,), None),
    "include_stop_str_in_output": ((bool,), None),
}
# set to anything but these values, the field asks for something Folio does not serve
_UNSUPPORTED = {"echo": (False,), "suffix": ("",), "logit_bias": ({},), "tools": ([],),
                "tool_choice": ("none", "auto"), "best_of": (1,), "cache_salt": (),
                "response_format": ({"type": "text"},)}


@dataclass(frozen=True, slots=True)
class ValidationLimits:
    """What a request may ask for: the model's limits and the YAML's ``api`` section."""

    max_model_len: int
    vocab_size: int
    max_n: int = 16
    max_stop_strings: int = 16
    max_logprobs: int = 20


@dataclass(slots=True)
class CheckedRequest:
    """A completion or chat body after validation: what to tokenize and how to sample."""

    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt: str | list[int] | None = None  # completions
    max_tokens_param: str = "max_tokens"  # the field that set params.max_tokens
    messages: list[dict[str, Any]] | None = None  # chat
    add_generation_prompt: bool = True


def _type_name(types: tuple) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object"}[types[-1] if types == _NUMBER else types[0]]


def typed(body: dict, key: str, types: tuple, bounds: tuple | None = None) -> Any:
    """``body[key]`` if it has one of ``types`` (bool is never an int) and lies in bounds."""
    value = body[key]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise bad(f"'{key}' must be a{'n' if _type_name(types)[0] in 'aeiou' else ''} "
                  f"{_type_name(types)}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"'{key}' must be a finite number", key)
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise bad(f"'{key}' must be at least {bounds[0]}" if bounds[1] == INT64_MAX
                  else f"'{key}' must be in [{bounds[0]}, {bounds[1]}]", key)
    return value


class RequestValidator:
    """Checks bodies against one model's :class:`ValidationLimits`."""

    def __init__(self, limits: ValidationLimits):
        self.limits = limits

    def _token_ids(self, value: Any, key: str) -> list[int]:
        if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise bad(f"'{key}' must be a list of token ids", key)
        if any(t < 0 or t >= self.limits.vocab_size for t in value):
            raise bad(f"'{key}' holds token ids outside the vocabulary "
                      f"[0, {self.limits.vocab_size})", key)
        return value

    def sampling_params(self, body: dict, *, chat: bool) -> SamplingParams:
        """Validated SamplingParams from an OpenAI completion or chat body."""
        lim = self.limits
        for key, allowed in _UNSUPPORTED.items():
            if body.get(key) is not None and body[key] not in allowed:
                raise bad(f"'{key}' is not supported by this server", key)
        kwargs: dict[str, Any] = {k: typed(body, k, types, bounds)
                                  for k, (types, bounds) in _FIELDS.items()
                                  if body.get(k) is not None}
        if body.get("n") is not None:
            kwargs["n"] = typed(body, "n", (int,), (1, lim.max_n))
        if body.get("top_k") is not None:
            kwargs["top_k"] = typed(body, "top_k", (int,), (-1, lim.vocab_size))
        kwargs["max_tokens"] = None  # chat: max_completion_tokens wins over max_tokens
        for key in ("max_tokens", "max_completion_tokens")[:1 + chat]:
            if body.get(key) is not None:
                kwargs["max_tokens"] = typed(body, key, (int,), (1, INT64_MAX))
        if body.get("min_tokens") is not None:
            kwargs["min_tokens"] = typed(body, "min_tokens", (int,), (0, lim.max_model_len))
        if body.get("stop_token_ids") is not None:
            kwargs["stop_token_ids"] = self._token_ids(body["stop_token_ids"], "stop_token_ids")
        if body.get("stop") is not None:
            kwargs["stop"] = self._stop(body["stop"])
        if body.get("user") is not None:
            typed(body, "user", (str,))
        self._logprobs(body, chat, kwargs)
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError as e:
            raise bad(str(e), e.param) from None

    def _stop(self, stop: Any) -> list[str]:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if len(stop) > self.limits.max_stop_strings:
            raise bad(f"'stop' may hold at most {self.limits.max_stop_strings} strings",
                      "stop")
        if not all(stop):
            raise bad("stop strings must not be empty", "stop")
        return stop

    def _logprobs(self, body: dict, chat: bool, kwargs: dict) -> None:
        bounds = (0, self.limits.max_logprobs)
        if not chat:
            if body.get("logprobs") is not None:
                kwargs["logprobs"] = typed(body, "logprobs", (int,), bounds)
            return
        wanted = body.get("logprobs") is not None and typed(body, "logprobs", (bool,))
        if body.get("top_logprobs") is not None:
            top = typed(body, "top_logprobs", (int,), bounds)
            if not wanted:
                raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            kwargs["logprobs"] = top
        elif wanted:
            kwargs["logprobs"] = 0

    def completion(self, body: dict) -> CheckedRequest:
        """A completion body: one prompt (text or token ids) and its sampling."""
        stream, include_usage = stream_flags(body)
        params = self.sampling_params(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise bad("'prompt' must not be empty", "prompt")
        elif isinstance(prompt, list) and prompt and not any(
                isinstance(p, (str, list)) for p in prompt):
            self._token_ids(prompt, "prompt")
        else:
            raise bad("'prompt' must be a non-empty string or list of token ids (batches of "
                      "several prompts are not served)", "prompt")
        return CheckedRequest(params, stream, include_usage, prompt=prompt)

    def chat(self, body: dict) -> CheckedRequest:
        """A chat body: the conversation's shape and its sampling."""
        stream, include_usage = stream_flags(body)
        params = self.sampling_params(body, chat=True)
        messages = checked_messages(body.get("messages"))
        add = (typed(body, "add_generation_prompt", (bool,))
               if body.get("add_generation_prompt") is not None else True)
        param = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
                 else "max_tokens")
        return CheckedRequest(params, stream, include_usage, messages=messages,
                              add_generation_prompt=add, max_tokens_param=param)

    def check_prompt_ids(self, ids: list[int], params: SamplingParams,
                         max_tokens_param: str = "max_tokens") -> list[int]:
        """The tokenized prompt against the context: room for max_tokens, ids in vocab."""
        lim = self.limits
        if not ids:
            raise bad("the prompt is empty after tokenization", "prompt")
        if len(ids) >= lim.max_model_len:
            raise bad(f"the prompt has {len(ids)} tokens; this model's maximum context is "
                      f"{lim.max_model_len}", "prompt")
        room = lim.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise bad(f"{max_tokens_param} ({params.max_tokens}) exceeds the room left after "
                      f"the prompt ({room} of {lim.max_model_len} tokens)", max_tokens_param)
        self._token_ids(ids, "prompt")
        return ids


def checked_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation, or a 400 naming ``messages``."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    try:
        validate_messages(messages)
    except ChatTemplateError as e:
        raise bad(str(e), "messages") from None
    return messages


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage); ``stream_options`` is only allowed with ``stream``."""
    stream = typed(body, "stream", (bool,)) if body.get("stream") is not None else False
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False),
                                                        bool):
        raise bad("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    return stream, bool(options.get("include_usage", False))


def check_model(body: dict, served_name: str) -> None:
    """404 naming ``model`` unless it is absent or the served model's name."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model != served_name:
        raise APIError(404, f"model {model[:100]!r} does not exist", "not_found_error",
                       "model", "model_not_found")
