"""Every field of an OpenAI completion or chat body, checked before any tokenization.

The first field that is wrong becomes one 400 whose ``param`` names it, so an error
body stays small however many fields are wrong. Integers are bounded so they fit the
engine's int64 wire format and tensors; per-request lists and strings (stop strings,
stop_token_ids, prompt ids) are bounded by the ``api`` section before their elements
are checked, in one pass. A text prompt that must become more than ``max_model_len``
tokens is refused from its character count (:meth:`RequestValidator.check_prompt_text`,
text/token_span.py) before tokenization, and its token count is checked again after
(:meth:`RequestValidator.check_prompt_ids`).

Fields OpenAI defines that Folio does not serve (``suffix``, ``best_of`` > 1) are
refused when set to anything but their default (services/api/fields.py) rather than
silently ignored; other unknown fields are ignored, as vLLM does. The
fields that constrain the output (``response_format``, ``structured_outputs``,
``guided_*``, ``tools``/``tool_choice``) are read by services/api/structured_request.py;
their grammar is compiled before the request reaches the engine (grammar_check.py).
``cache_salt`` is refused: the server derives it from the caller's API key
(services/api/auth.py) and never takes it from a client.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.schema import APIConfig
from engine_core.sampling_params import MAX_LOGIT_BIAS, InvalidRequestError, SamplingParams
from services.api.completion_choices import ResponseOptions
from services.api.fields import (INT64, NUMBER, Range, chat_prompt_flags, check_refused,
                                 token_ids, typed)
from services.api.openai_protocol import APIError, bad
from services.api.structured_request import StructuredRequest, structured_request
from text.chat_template import ChatTemplateError, validate_messages
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


@dataclass(slots=True)
class CheckedRequest:
    """A completion or chat body after validation: what to tokenize and how to sample."""

    params: SamplingParams
    stream: bool
    include_usage: bool
    prompts: list[str | list[int]] | None = None  # completions: texts or token ids
    max_tokens_param: str = "max_tokens"  # the field that set params.max_tokens
    messages: list[dict[str, Any]] | None = None  # chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # chat: the final message is left open
    structured: StructuredRequest | None = None  # what the output must match
    tools: list[dict[str, Any]] | None = None  # chat: rendered by templates that know them
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    options: ResponseOptions = ResponseOptions()  # what the answer shows
    truncate_prompt_tokens: int | None = None  # keep at most this many prompt tokens
    truncation_side: str = "left"  # "left": keep the prompt's end; "right": its start

    def truncated(self, ids: list[int]) -> list[int]:
        """The prompt's ids as ``truncate_prompt_tokens`` and ``truncation_side`` say."""
        keep = self.truncate_prompt_tokens
        if keep is None or len(ids) <= keep:
            return ids
        return ids[-keep:] if self.truncation_side == "left" else ids[:keep]


class RequestValidator:
    """Checks bodies against one model's :class:`ValidationLimits`."""

    def __init__(self, limits: ValidationLimits):
        self.limits = limits

    def _token_ids(self, value: Any, key: str, max_count: int | None = None) -> list[int]:
        return token_ids(value, key, self.limits.vocab_size, max_count)

    def sampling_params(self, body: dict, *, chat: bool,
                        structured: StructuredRequest | None = None) -> SamplingParams:
        """Validated SamplingParams from an OpenAI completion or chat body."""
        lim = self.limits
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
            kwargs["prompt_logprobs"] = self._prompt_logprobs(body)
        if body.get("logit_bias") is not None:
            kwargs["logit_bias"] = self._logit_bias(body["logit_bias"]) or None
        if body.get("min_tokens") is not None:
            kwargs["min_tokens"] = typed(body, "min_tokens", (int,),
                                         Range(0, lim.max_model_len))
        if body.get("stop_token_ids") is not None:
            kwargs["stop_token_ids"] = self._token_ids(body["stop_token_ids"],
                                                       "stop_token_ids", lim.max_stop_token_ids)
        if body.get("stop") is not None:
            kwargs["stop"] = self._stop(body["stop"])
        if body.get("user") is not None:
            typed(body, "user", (str,))
        self._logprobs(body, chat, kwargs)
        if structured is not None:
            kwargs["structured_outputs"] = structured.params
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError as e:
            raise bad(str(e), e.param) from None

    def _logit_bias(self, bias: Any) -> dict[int, float]:
        """OpenAI's ``{"token id": bias}``: ids in the vocabulary, biases in [-100, 100]."""
        vocab = self.limits.vocab_size
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

    def _prompt_logprobs(self, body: dict) -> int:
        top = typed(body, "prompt_logprobs", (int,), Range(-1, self.limits.max_logprobs))
        if top == -1:
            raise bad("'prompt_logprobs' -1 (the whole vocabulary at every prompt "
                      f"position) is not served; ask for at most {self.limits.max_logprobs}",
                      "prompt_logprobs")
        return top

    def _options(self, body: dict, params: SamplingParams, echo: bool,
                 discard_output: bool) -> ResponseOptions:
        flags = {key: typed(body, key, (bool,)) if body.get(key) is not None else False
                 for key in ("return_token_ids", "return_tokens_as_token_ids")}
        return ResponseOptions(echo=echo, discard_output=discard_output,
                               num_logprobs=params.logprobs,
                               num_prompt_logprobs=params.prompt_logprobs,
                               return_token_ids=flags["return_token_ids"],
                               tokens_as_token_ids=flags["return_tokens_as_token_ids"])

    def _stop(self, stop: Any) -> list[str]:
        """One string or a bounded list of them, each non-empty and bounded: one pass."""
        lim = self.limits
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

    def _logprobs(self, body: dict, chat: bool, kwargs: dict) -> None:
        bounds = Range(0, self.limits.max_logprobs)
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
        """A completion body: its prompts (one text or token-id list, or a list of them)
        and their sampling. A text prompt that cannot fit the context is refused here,
        before it is tokenized. ``echo`` with ``max_tokens`` 0 runs one token and shows
        none (services/api/completion_choices.py)."""
        stream, include_usage, continuous = stream_flags(body)
        structured = structured_request(body, chat=False,
                                        max_chars=self.limits.max_grammar_chars)
        echo = typed(body, "echo", (bool,)) if body.get("echo") is not None else False
        discard = echo and body.get("max_tokens") is not None and typed(
            body, "max_tokens", (int,)) == 0
        params = self.sampling_params({**body, "max_tokens": 1} if discard else body,
                                      chat=False, structured=structured)
        options = self._options(body, params, echo, discard)
        if echo and params.logprobs is not None:  # the prompt's own tokens get scored
            params = params.clone(prompt_logprobs=max(params.logprobs,
                                                      params.prompt_logprobs or 0))
        keep, side = self._truncation(body)
        return CheckedRequest(params, stream, include_usage,
                              prompts=self._prompts(body.get("prompt"), keep is None),
                              structured=structured, continuous_usage=continuous,
                              options=options, truncate_prompt_tokens=keep,
                              truncation_side=side)

    def _truncation(self, body: dict) -> tuple[int | None, str]:
        """vLLM's ``truncate_prompt_tokens`` (-1: the context less one token for the
        output) and ``truncation_side``."""
        keep, side = None, "left"
        if body.get("truncate_prompt_tokens") is not None:
            keep = typed(body, "truncate_prompt_tokens", (int,),
                         Range(-1, self.limits.max_model_len - 1))
            if keep == 0:
                raise bad("'truncate_prompt_tokens' must be -1 or at least 1",
                          "truncate_prompt_tokens")
            keep = self.limits.max_model_len - 1 if keep == -1 else keep
        if body.get("truncation_side") is not None:
            side = typed(body, "truncation_side", (str,))
            if side not in ("left", "right"):
                raise bad("'truncation_side' must be \"left\" or \"right\"",
                          "truncation_side")
        return keep, side

    def _prompts(self, prompt: Any, bound_text: bool = True) -> list[str | list[int]]:
        """``prompt`` as a list of prompts: a text, a token-id list, or a non-empty list
        of either (OpenAI's batch); each checked like a single prompt."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > self.limits.max_batch_prompts:
                raise bad(f"'prompt' may hold at most {self.limits.max_batch_prompts} "
                          f"prompts", "prompt")
            batch = prompt
        else:
            batch = [prompt]
        for one in batch:
            self._prompt(one, bound_text)
        return batch

    def _prompt(self, prompt: Any, bound_text: bool) -> None:
        """``bound_text`` False (truncation asked for): a long prompt is cut, not refused
        (the body's size still bounds the work)."""
        if isinstance(prompt, str):
            if not prompt:
                raise bad("'prompt' must not be empty", "prompt")
            if bound_text:
                self.check_prompt_text(prompt, "prompt")
        elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list)):
            if bound_text and len(prompt) >= self.limits.max_model_len:
                raise bad(_too_many_tokens(len(prompt), self.limits.max_model_len), "prompt")
            self._token_ids(prompt, "prompt")
        else:
            raise bad("'prompt' must be a non-empty string, a list of token ids, or a "
                      "non-empty list of those", "prompt")

    def chat(self, body: dict) -> CheckedRequest:
        """A chat body: the conversation's shape and its sampling."""
        stream, include_usage, continuous = stream_flags(body)
        structured = structured_request(body, chat=True,
                                        max_chars=self.limits.max_grammar_chars)
        params = self.sampling_params(body, chat=True, structured=structured)
        echo = typed(body, "echo", (bool,)) if body.get("echo") is not None else False
        options = self._options(body, params, echo, False)
        keep, side = self._truncation(body)
        messages = checked_messages(body.get("messages"))
        add, cont = chat_prompt_flags(body)
        param = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
                 else "max_tokens")
        tools = body.get("tools") if structured is not None and structured.tools else None
        return CheckedRequest(params, stream, include_usage, messages=messages,
                              add_generation_prompt=add, continue_final_message=cont,
                              max_tokens_param=param,
                              structured=structured, tools=tools,
                              continuous_usage=continuous, options=options,
                              truncate_prompt_tokens=keep, truncation_side=side)

    def check_prompt_text(self, text: str, param: str, room: int = 1) -> None:
        """400 naming ``param`` when ``text`` must become more than max_model_len - room
        tokens (``room``: tokens the context must keep free; 1 for a generation), decided
        from its characters alone (text/token_span.py) before anything tokenizes it."""
        lim, span = self.limits, self.limits.token_span
        if span is None:  # this tokenizer gives no sound bound
            return
        min_tokens = span.min_tokens(text)
        if min_tokens > lim.max_model_len - room:
            raise bad(f"the {param} has {len(text)} characters, so at least {min_tokens} "
                      f"tokens; this model's maximum context is {lim.max_model_len}", param)

    def check_prompt_ids(self, ids: list[int], params: SamplingParams,
                         max_tokens_param: str = "max_tokens") -> list[int]:
        """The tokenized prompt against the context: room for max_tokens, ids in vocab."""
        lim = self.limits
        if not ids:
            raise bad("the prompt is empty after tokenization", "prompt")
        if len(ids) >= lim.max_model_len:
            raise bad(_too_many_tokens(len(ids), lim.max_model_len), "prompt")
        room = lim.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise bad(f"{max_tokens_param} ({params.max_tokens}) exceeds the room left after "
                      f"the prompt ({room} of {lim.max_model_len} tokens)", max_tokens_param)
        self._token_ids(ids, "prompt")
        return ids


def _too_many_tokens(num_tokens: int, max_model_len: int) -> str:
    return (f"the prompt has {num_tokens} tokens; this model's maximum context is "
            f"{max_model_len}")


def checked_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation, or a 400 naming ``messages``."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    try:
        validate_messages(messages)
    except ChatTemplateError as e:
        raise bad(str(e), "messages") from None
    return messages


def stream_flags(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats); ``stream_options`` is only
    allowed with ``stream``, and holds only those two booleans."""
    stream = typed(body, "stream", (bool,)) if body.get("stream") is not None else False
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    known = ("include_usage", "continuous_usage_stats")
    if not isinstance(options, dict) or set(options) - set(known) or not all(
            isinstance(options.get(k, False), bool) for k in known):
        raise bad("'stream_options' must be {\"include_usage\": bool, "
                  "\"continuous_usage_stats\": bool}", "stream_options")
    return stream, bool(options.get("include_usage", False)), bool(
        options.get("continuous_usage_stats", False))


MAX_MODEL_NAME_CHARS = 256


def check_model(body: dict, served_name: str, allow_adapters: bool = False) -> str | None:
    """The LoRA adapter ``model`` names, None for the served model (or none named).

    Without adapters any other name is a 404 here; with them the engine core, the one
    registry of adapters, answers an unknown name with the same 404."""
    model = body.get("model")
    if model is None or model == served_name:
        return None
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if not allow_adapters or not 0 < len(model) <= MAX_MODEL_NAME_CHARS:
        raise model_not_found(model)
    return model


def model_not_found(model: str) -> APIError:
    return APIError(404, f"model {model[:100]!r} does not exist", "not_found_error",
                    "model", "model_not_found")
