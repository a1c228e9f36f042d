"""What a client gets back for a request: vLLM's RequestOutput / CompletionOutput shape."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.outputs import TokenLogprobs
from text.logprob import Logprob


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (``n`` of them when n > 1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # logprobs set: vLLM's shape, one {token_id: Logprob} dict per generated token (the
    # sampled token and the top-k there); filled offline when the request ends
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    # the same as the engine sent them, growing as tokens arrive (what the API renders)
    token_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request with all its samples; ``finished`` once every sample has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # prompt_logprobs set: vLLM's shape (None, then {token_id: Logprob} per prompt token)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # the same as the engine sent them: prompt tokens 1.. (what the API renders)
    prompt_token_logprobs: list[TokenLogprobs] | None = None
