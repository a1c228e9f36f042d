"""Values that flow back from the model runner and out of the engine core."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine_core.structured_outputs import StructuredOutputReport


class FinishReason(str, enum.Enum):
    """Why a request stopped (the OpenAI ``finish_reason`` strings)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities around one sampled token.

    ``logprob`` and ``rank`` describe the sampled token (rank 1 = most likely);
    ``top_token_ids``/``top_logprobs`` hold the k most likely tokens, best first.
    Values come from the model's raw distribution, before temperature and penalties.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of a run of prompt tokens, computed by one step's prefill chunk.

    ``logprobs[j]`` is prompt token ``start + j`` given the tokens before it; the first
    prompt token has none, so ``start`` is at least 1."""

    start: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests whose computed tokens reached the
    end of their known tokens (a partial prefill chunk samples nothing).

    ``sampled_token_ids[i]`` and ``logprobs[i]`` belong to ``req_ids[i]``; each is a list
    so that a step may accept several tokens per request (speculative decoding).
    ``structured_output``: what the grammars did (None when no grammar was involved).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    structured_output: StructuredOutputReport | None = None
    # req_id → its prompt tokens' logprobs computed this step (prompt_logprobs set)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens for one request after a step (a delta), plus its finish if it ended."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id, when one ended the request
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    parent_req_id: str | None = None  # set on the samples of an n > 1 request
    index: int = 0  # which sample of its parent this is
    # on the first output of sample 0 when prompt_logprobs is set: prompt tokens 1.. N-1
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
