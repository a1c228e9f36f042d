"""The sampling fields of an OpenAI completion or chat body, read into SamplingParams,
and the limits every field is checked against (the model's and the YAML's ``api``).

Per-request lists and strings (stop strings, stop_token_ids, logit_bias) are bounded
before their elements are checked, in one pass; integers are bounded to fit the
engine's int64 wire format. SamplingParams re-checks the values' relations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.schema import APIConfig
from engine_core.sampling_params import MAX_LOGIT_BIAS, InvalidRequestError, SamplingParams
from services.api.fields import INT64, NUMBER, Range, check_refused, token_ids, typed
from services.api.openai_protocol import bad
from services.api.structured_request import StructuredRequest
from text.token_span import TokenSpan

# field → (accepted types, bounds or None); SamplingParams re-checks the rest
_FIELDS: dict[str, tuple[tuple, Range | None]] = {
    "temperature": (NUMBER, Range(0.0, 2.0)), "top_p": (NUMBER, Range(0.0, 1.0, True)),
    "min_p": (NUMBER, Range(0.0, 1.0)), "seed": ((int,), INT64),
    "presence_penalty": (NUMBER, Range(-2.0, 2.0)),
    "frequency_penalty": (NUMBER, Range(-2.0, 2.0)),
    "repetition_penalty": (NUMBER, Range(0.0, float(2 ** 16), True)),
    "priority": ((int,), INT64), "ignore_eos": ((bool,), None),
    "skip_special_tokens": ((bool,), None), "include_stop_str_in_output": ((bool,), None),
}


@dataclass(frozen=True, slots=True)
class ValidationLimits:
    """What a request may ask for: the model's limits and the YAML's ``api`` section."""

    max_model_len: int
    vocab_size: int
    max_n: int = 16
    max_batch_prompts: int = 64
    max_stop_strings: int = 16
    max_logprobs: int = 20
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 256  # never above vocab_size (from_config sees to that)
    token_span: TokenSpan | None = None  # None: no cheap bound on a text's token count
    max_grammar_chars: int = 65536

    @classmethod
    def from_config(cls, api: APIConfig, max_model_len: int, vocab_size: int,
                    token_span: TokenSpan | None) -> "ValidationLimits":
        return cls(max_model_len, vocab_size, api.max_n, api.max_batch_prompts,
                   api.max_stop_strings,
                   api.max_logprobs, api.max_stop_string_chars,
                   min(api.max_stop_token_ids, vocab_size), token_span,
                   api.max_grammar_chars)


def sampling_params(body: dict, lim: ValidationLimits, *, chat: bool,
                    structured: StructuredRequest | None = None) -> SamplingParams:
    """Validated SamplingParams from an OpenAI completion or chat body."""
    check_refused(body)
    kwargs: dict[str, Any] = {k: typed(body, k, types, bounds)
                              for k, (types, bounds) in _FIELDS.items()
                              if body.get(k) is not None}
    if body.get("n") is not None:
        kwargs["n"] = typed(body, "n", (int,), Range(1, lim.max_n))
    if body.get("top_k") is not None:
        kwargs["top_k"] = typed(body, "top_k", (int,), Range(-1, lim.vocab_size))
    kwargs["max_tokens"] = None  # chat: max_completion_tokens wins over max_tokens
    for key in ("max_tokens", "max_completion_tokens")[:1 + chat]:
        if body.get(key) is not None:
            kwargs["max_tokens"] = typed(body, key, (int,), Range(1, INT64.hi))
    if body.get("prompt_logprobs") is not None:
        kwargs["prompt_logprobs"] = _prompt_logprobs(body, lim.max_logprobs)
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"], lim.vocab_size) or None
    if body.get("min_tokens") is not None:
        kwargs["min_tokens"] = typed(body, "min_tokens", (int,),
                                     Range(0, lim.max_model_len))
    if body.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = token_ids(body["stop_token_ids"], "stop_token_ids",
                                           lim.vocab_size, lim.max_stop_token_ids)
    if body.get("stop") is not None:
        kwargs["stop"] = _stop(body["stop"], lim)
    if body.get("user") is not None:
        typed(body, "user", (str,))
    _logprobs(body, chat, kwargs, lim.max_logprobs)
    if structured is not None:
        kwargs["structured_outputs"] = structured.params
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise bad(str(e), e.param) from None

def _logit_bias(bias: Any, vocab: int) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}``: ids in the vocabulary, biases in [-100, 100]."""
    if not isinstance(bias, dict):
        raise bad("'logit_bias' must map token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    checked = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise bad(f"'logit_bias' keys must be token ids, got {key[:20]!r}",
                      "logit_bias")
        token_id = int(key)
        if token_id >= vocab:
            raise bad(f"'logit_bias' holds token id {token_id}, outside the vocabulary "
                      f"of {vocab} tokens (ids 0 to {vocab - 1})", "logit_bias")
        checked[token_id] = typed({"logit_bias": value}, "logit_bias", NUMBER,
                                  Range(-100.0, 100.0))
    return checked

def _prompt_logprobs(body: dict, max_logprobs: int) -> int:
    top = typed(body, "prompt_logprobs", (int,), Range(-1, max_logprobs))
    if top == -1:
        raise bad("'prompt_logprobs' -1 (the whole vocabulary at every prompt "
                  f"position) is not served; ask for at most {max_logprobs}",
                  "prompt_logprobs")
    return top

def _stop(stop: Any, lim: ValidationLimits) -> list[str]:
    """One string or a bounded list of them, each non-empty and bounded: one pass."""
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > lim.max_stop_strings:
        raise bad(f"'stop' may hold at most {lim.max_stop_strings} strings", "stop")
    for s in stop:
        if not isinstance(s, str):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if not s:
            raise bad("stop strings must not be empty", "stop")
        if len(s) > lim.max_stop_string_chars:
            raise bad(f"each stop string may hold at most {lim.max_stop_string_chars} "
                      f"characters", "stop")
    return stop

def _logprobs(body: dict, chat: bool, kwargs: dict, max_logprobs: int) -> None:
    bounds = Range(0, max_logprobs)
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
