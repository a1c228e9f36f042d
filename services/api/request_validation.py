"""Every field of an OpenAI completion or chat body, checked before any tokenization.

The first field that is wrong becomes one 400 whose ``param`` names it, so an error
body stays small however many fields are wrong. The sampling fields are read by
services/api/sampling_fields.py. Integers are bounded so they fit the
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

from engine_core.sampling_params import SamplingParams
from services.api.completion_choices import ResponseOptions
from services.api.fields import Range, chat_prompt_flags, token_ids, typed
from services.api.openai_protocol import APIError, bad
from services.api.sampling_fields import ValidationLimits, sampling_params
from services.api.structured_request import StructuredRequest, structured_request
from text.chat_template import ChatTemplateError, validate_messages

__all__ = ["CheckedRequest", "RequestValidator", "ValidationLimits", "check_model",
           "checked_messages", "model_not_found", "stream_flags"]

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
        return sampling_params(body, self.limits, chat=chat, structured=structured)

    def _options(self, body: dict, params: SamplingParams, echo: bool,
                 discard_output: bool) -> ResponseOptions:
        flags = {key: typed(body, key, (bool,)) if body.get(key) is not None else False
                 for key in ("return_token_ids", "return_tokens_as_token_ids")}
        return ResponseOptions(echo=echo, discard_output=discard_output,
                               num_logprobs=params.logprobs,
                               num_prompt_logprobs=params.prompt_logprobs,
                               return_token_ids=flags["return_token_ids"],
                               tokens_as_token_ids=flags["return_tokens_as_token_ids"])

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
