"""OpenAI response and stream-chunk JSON for completions and chat completions."""
from __future__ import annotations

from typing import Any

from engine_core.outputs import TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached(samples) -> int:
    # sample 0 computed the prompt; later samples fork from it (their "cached" prefix
    # is the sibling's, not the prefix cache's)
    return next((s.num_cached_tokens for s in samples if s.index == 0), 0)


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(logprobs: list[TokenLogprobs], tokenizer) -> dict | None:
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


def chat_logprobs(logprobs: list[TokenLogprobs], tokenizer) -> dict | None:
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


def completion_response(samples, num_prompt_tokens, tokenizer, *, req_id, model,
                        created) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": s.index, "text": s.text,
                         "logprobs": completion_logprobs(s.logprobs, tokenizer),
                         "finish_reason": s.finish_reason} for s in samples],
            "usage": usage(num_prompt_tokens, sum(len(s.token_ids) for s in samples),
                           _cached(samples))}


def chat_response(samples, num_prompt_tokens, tokenizer, *, req_id, model, created) -> dict:
    return {"id": req_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": s.index,
                         "message": {"role": "assistant", "content": s.text},
                         "logprobs": chat_logprobs(s.logprobs, tokenizer),
                         "finish_reason": s.finish_reason} for s in samples],
            "usage": usage(num_prompt_tokens, sum(len(s.token_ids) for s in samples),
                           _cached(samples))}


def completion_chunk(delta, tokenizer, *, req_id, model, created) -> dict:
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": delta.index, "text": delta.text,
                         "logprobs": completion_logprobs(delta.logprobs, tokenizer),
                         "finish_reason": delta.finish_reason}]}


def chat_chunk(delta, tokenizer, *, req_id, model, created, role: bool = False) -> dict:
    body = {"role": "assistant", "content": ""} if role else {"content": delta.text}
    return {"id": req_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": delta.index, "delta": body,
                         "logprobs": None if role else chat_logprobs(delta.logprobs, tokenizer),
                         "finish_reason": None if role else delta.finish_reason}]}
