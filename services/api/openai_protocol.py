"""OpenAI request bodies → (prompt token ids, SamplingParams), and OpenAI's error shape.

Every field is checked here, before tokenization or the engine sees it; a bad one is
an APIError whose ``param`` names it. Messages never echo large inputs back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine_core.sampling_params import InvalidRequestError, SamplingParams


@dataclass(slots=True)
class APIError(Exception):
    """An error the client sees as ``{"error": {"message", "type", "param", "code"}}``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message[:1000], "type": self.type,
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str, code: str = "engine_unavailable") -> APIError:
    """503: the engine is gone or this process is draining; retrying later may work."""
    return APIError(503, message, "service_unavailable", code=code)


# OpenAI / vLLM field → (SamplingParams field, accepted python types)
_NUMBER = (int, float)
_FIELDS = {
    "temperature": ("temperature", _NUMBER), "top_p": ("top_p", _NUMBER),
    "top_k": ("top_k", (int,)), "min_p": ("min_p", _NUMBER), "seed": ("seed", (int,)),
    "n": ("n", (int,)), "presence_penalty": ("presence_penalty", _NUMBER),
    "frequency_penalty": ("frequency_penalty", _NUMBER),
    "repetition_penalty": ("repetition_penalty", _NUMBER),
    "min_tokens": ("min_tokens", (int,)), "ignore_eos": ("ignore_eos", (bool,)),
    "stop_token_ids": ("stop_token_ids", (list,)), "priority": ("priority", (int,)),
    "skip_special_tokens": ("skip_special_tokens", (bool,)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (bool,)),
}


def _typed(body: dict, key: str, types: tuple) -> Any:
    value = body[key]
    if isinstance(value, bool) and bool not in types:
        raise bad(f"'{key}' must be a {types[0].__name__}", key)
    if not isinstance(value, types):
        raise bad(f"'{key}' must be a {types[0].__name__}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"'{key}' must be finite", key)
    return value


def sampling_params_from(body: dict, *, chat: bool) -> SamplingParams:
    """Build validated SamplingParams from an OpenAI completion or chat body."""
    kwargs: dict[str, Any] = {}
    for key, (name, types) in _FIELDS.items():
        if body.get(key) is not None:
            kwargs[name] = _typed(body, key, types)
    max_key = "max_completion_tokens" if chat and body.get(
        "max_completion_tokens") is not None else "max_tokens"
    kwargs["max_tokens"] = (_typed(body, max_key, (int,)) if body.get(max_key) is not None
                            else None)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        kwargs["stop"] = stop
    logprobs = body.get("top_logprobs" if chat else "logprobs")
    if chat and body.get("logprobs"):
        kwargs["logprobs"] = _typed(body, "top_logprobs", (int,)) if logprobs is not None else 0
    elif not chat and logprobs is not None:
        kwargs["logprobs"] = _typed(body, "logprobs", (int,))
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise bad(str(e), e.param) from None


def check_stream_options(body: dict) -> bool:
    """Whether usage goes at the end of a stream; stream_options needs stream."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False),
                                                        bool):
        raise bad("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    return bool(options.get("include_usage", False))


def completion_prompt(body: dict) -> str | list[int]:
    """One prompt: a string or a list of token ids (batched prompts are not served)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
