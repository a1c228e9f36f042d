"""OpenAI response and stream-chunk JSON for completions and chat completions.

Full responses are rendered from a finished ``RequestOutput``, stream chunks from one
``SampleDelta`` (both from text/request_state.py, the output path the offline ``LLM``
shares).
"""
from __future__ import annotations

from typing import Any

from engine_core.outputs import TokenLogprobs
from services.api.completion_choices import (CompletionChoices, prompt_logprobs_json,
                                            token_text)
from services.api.tool_calls import ToolCallFormat, tool_call_message
from text.request_output import RequestOutput
from text.request_state import SampleDelta


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def output_usage(outputs: list[RequestOutput], count_output: bool = True) -> dict:
    """The usage object of a whole request (every prompt's, every sample's tokens);
    ``count_output`` False: the sampled tokens were not shown (echo, max_tokens 0)."""
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs)
                 if count_output else 0,
                 sum(o.num_cached_tokens for o in outputs))


def chat_logprobs(logprobs: list[TokenLogprobs] | None, tokenizer,
                  tokens_as_token_ids: bool = False) -> dict | None:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if not logprobs:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id, tokens_as_token_ids)
        # the token's own bytes: joined over tokens they spell characters no one token
        # holds whole (the text alone shows U+FFFD for those)
        raw = text.encode() if tokens_as_token_ids else tokenizer.token_bytes(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids,
                                                                      lp.top_logprobs)]}
                        for lp in logprobs]}


def completion_response(choices: CompletionChoices, outputs: list[RequestOutput], *,
                        req_id, model, created) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices.full(outputs),
            "usage": output_usage(outputs, not choices.options.discard_output)}


def completion_chunk(choices: list[dict], *, req_id, model, created) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices}


def chat_echo(checked) -> str:
    """``echo``: the last message's text when the assistant wrote it (the reply goes on
    from it); empty otherwise."""
    last = (checked.messages or [{}])[-1]
    content = last.get("content")
    if not checked.options.echo or last.get("role") != "assistant":
        return ""
    if isinstance(content, list):  # text parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _chat_extras(body: dict, checked, tokenizer, output: RequestOutput) -> dict:
    options = checked.options
    if options.return_token_ids:
        body["prompt_token_ids"] = output.prompt_token_ids
    if options.num_prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(
            output.prompt_token_logprobs, options.num_prompt_logprobs,
            lambda t: token_text(tokenizer, t, options.tokens_as_token_ids))
    return body


def chat_response(outputs: list[RequestOutput], tokenizer, checked, *, req_id, model,
                  created, tools: ToolCallFormat | None = None) -> dict:
    """``tools``: the samples are tool calls (message.tool_calls, finish "tool_calls")."""
    options, prefix = checked.options, chat_echo(checked)
    choices = []
    for c in outputs[0].outputs:
        message, finish = (
            ({"role": "assistant", "content": prefix + c.text}, c.finish_reason)
            if tools is None else tool_call_message(c.text, c.finish_reason, tools))
        choice = {"index": c.index, "message": message,
                  "logprobs": chat_logprobs(c.token_logprobs, tokenizer,
                                            options.tokens_as_token_ids),
                  "finish_reason": finish, "stop_reason": c.stop_reason}
        if options.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return _chat_extras({"id": req_id, "object": "chat.completion", "created": created,
                         "model": model, "choices": choices, "usage": output_usage(outputs)},
                        checked, tokenizer, outputs[0])


def chat_chunk(delta: SampleDelta, tokenizer, checked, output: RequestOutput, *, req_id,
               model, created, role: bool = False) -> dict:
    """One chat stream event; the ``role`` one opens a choice (with the echoed text, and
    the prompt's ids and logprobs when asked for)."""
    options = checked.options
    body = {"role": "assistant", "content": chat_echo(checked)} if role else {
        "content": delta.text}
    choice = {"index": delta.index, "delta": body,
              "logprobs": None if role else chat_logprobs(delta.logprobs, tokenizer,
                                                         options.tokens_as_token_ids),
              "finish_reason": None if role else delta.finish_reason}
    if options.return_token_ids and not role:
        choice["token_ids"] = delta.token_ids
    event = {"id": req_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [choice]}
    return _chat_extras(event, checked, tokenizer, output) if role and delta.index == 0 \
        else event
