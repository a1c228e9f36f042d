"""The sizes a request must respect to be servable at all."""
from __future__ import annotations

from dataclasses import dataclass

from engine_core.kv_cache_manager import cdiv
from engine_core.sampling_params import InvalidRequestError


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Rejects at add time any request that could never complete.

    A request accepted here fits ``max_model_len`` and, alone, the whole KV pool, so
    the scheduler can always finish it by preempting others: it can never livelock.
    With chunked prefill off a prompt must also fit one step's token budget (the
    alternative, letting it overrun the budget, would break the budget invariant).
    """

    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool

    def check(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's ``max_tokens``, with None ("as many as fit") filled in as the
        room ``max_model_len`` leaves after the prompt; InvalidRequestError naming
        "prompt" or "max_tokens" if the request can't fit.

        This is the engine side's one fit check and the one place the default is
        filled in (the API process checks the same bounds before it sends a request).
        """
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens; max_model_len is "
                f"{self.max_model_len} and one output token must fit", "prompt")
        usable = self.num_blocks - 1
        if cdiv(num_prompt_tokens + 1, self.block_size) > usable:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) does not fit the KV cache "
                f"({usable} blocks of {self.block_size} tokens)", "prompt")
        if not self.enable_chunked_prefill and num_prompt_tokens > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with chunked prefill off", "prompt")
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})", "max_tokens")
        if cdiv(total, self.block_size) > usable:
            raise InvalidRequestError(
                f"prompt + max_tokens ({total} tokens) does not fit the KV cache "
                f"({usable} blocks of {self.block_size} tokens)", "max_tokens")
        return max_tokens
