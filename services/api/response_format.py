"""OpenAI response and stream-chunk JSON for completions and chat completions.

Full responses are rendered from a finished ``RequestOutput``, stream chunks from one
``SampleDelta`` (both from text/request_state.py, the output path the offline ``LLM``
shares).
"""
from __future__ import annotations

from typing import Any

from engine_core.outputs import TokenLogprobs
from text.request_output import RequestOutput
from text.request_state import SampleDelta


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def output_usage(outputs: list[RequestOutput]) -> dict:
    """The usage object of a whole request (every prompt's, every sample's tokens)."""
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs),
                 sum(o.num_cached_tokens for o in outputs))


def _choices(outputs: list[RequestOutput]):
    """(choice index, sample) of every sample: sample i of prompt k is k * n + i."""
    for k, output in enumerate(outputs):
        for c in output.outputs:
            yield k * len(output.outputs) + c.index, c


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(logprobs: list[TokenLogprobs] | None, tokenizer) -> dict | None:
    """The legacy completions ``logprobs`` object."""
    if not logprobs:
        return None
    return {
        "tokens": [_token(tokenizer, lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token(tokenizer, t): v for t, v in zip(lp.top_token_ids,
                                                                  lp.top_logprobs)}
                         for lp in logprobs],
        "text_offset": [],
    }


def chat_logprobs(logprobs: list[TokenLogprobs] | None, tokenizer) -> dict | None:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if not logprobs:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids,
                                                                      lp.top_logprobs)]}
                        for lp in logprobs]}


def completion_response(outputs: list[RequestOutput], tokenizer, *, req_id, model,
                        created) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": c.text,
                         "logprobs": completion_logprobs(c.logprobs, tokenizer),
                         "finish_reason": c.finish_reason}
                        for index, c in _choices(outputs)],
            "usage": output_usage(outputs)}


def chat_response(outputs: list[RequestOutput], tokenizer, *, req_id, model,
                  created) -> dict:
    return {"id": req_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": index,
                         "message": {"role": "assistant", "content": c.text},
                         "logprobs": chat_logprobs(c.logprobs, tokenizer),
                         "finish_reason": c.finish_reason}
                        for index, c in _choices(outputs)],
            "usage": output_usage(outputs)}


def completion_chunk(delta: SampleDelta, tokenizer, *, req_id, model, created) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": delta.index, "text": delta.text,
                         "logprobs": completion_logprobs(delta.logprobs, tokenizer),
                         "finish_reason": delta.finish_reason}]}


def chat_chunk(delta: SampleDelta, tokenizer, *, req_id, model, created,
               role: bool = False) -> dict:
    body = {"role": "assistant", "content": ""} if role else {"content": delta.text}
    return {"id": req_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": delta.index, "delta": body,
                         "logprobs": None if role else chat_logprobs(delta.logprobs, tokenizer),
                         "finish_reason": None if role else delta.finish_reason}]}
