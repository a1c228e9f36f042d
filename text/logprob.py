"""vLLM's logprob shape for the offline API: one ``{token_id: Logprob}`` dict per token.

Folio's engine speaks :class:`~engine_core.outputs.TokenLogprobs` (ids and floats);
scripts ported from vLLM read ``CompletionOutput.logprobs`` as one dict per generated
token (the sampled token and the top-k tokens at that position, each a
:class:`Logprob`) and ``RequestOutput.prompt_logprobs`` as a list whose first item is
None (the first prompt token has no context) and whose others are such dicts.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine_core.outputs import TokenLogprobs


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position, its rank (1 = most likely) and
    its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def position_logprobs(lp: TokenLogprobs, tokenizer) -> dict[int, Logprob]:
    """The token at this position and the top-k tokens there, by id."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    entries = {t: Logprob(v, rank, text(t)) for rank, (t, v) in enumerate(
        zip(lp.top_token_ids, lp.top_logprobs), start=1)}
    entries[lp.token_id] = Logprob(lp.logprob, lp.rank, text(lp.token_id))
    return entries


def prompt_logprobs(logprobs: list[TokenLogprobs],
                    tokenizer) -> list[dict[int, Logprob] | None]:
    """vLLM's ``RequestOutput.prompt_logprobs`` from prompt tokens 1.. of a request."""
    return [None] + [position_logprobs(lp, tokenizer) for lp in logprobs]
