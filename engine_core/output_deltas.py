"""The delta a request emits after a step: the tokens it kept, and its end if it ended."""
from __future__ import annotations

from engine_core.outputs import EngineCoreOutput, TokenLogprobs
from engine_core.request import Request, RequestStatus
from engine_core.stop_checker import append_until_stop


def make_delta(request: Request, new_ids: list[int], is_first: bool) -> EngineCoreOutput:
    """An output for ``request`` carrying ``new_ids`` (prefix hits on its first one)."""
    return EngineCoreOutput(
        req_id=request.req_id, new_token_ids=new_ids,
        num_cached_tokens=max(request.num_cached_tokens, 0) if is_first else 0,
        parent_req_id=request.parent_req_id, index=request.index)


def append_tokens(request: Request, token_ids: list[int],
                  logprobs: list[TokenLogprobs] | None, max_model_len: int,
                  grammar_ended: bool = False
                  ) -> tuple[EngineCoreOutput, RequestStatus | None]:
    """Append sampled tokens up to the first stop rule that fires (tokens after it, e.g.
    the rest of an accepted draft run, are dropped); the delta and the finished status
    reached, if any (the caller finishes the request, then sets ``finish_reason``).
    ``grammar_ended``: see ``check_stop``."""
    is_first = request.num_output_tokens == 0
    new_ids, status = append_until_stop(request, token_ids, max_model_len, grammar_ended)
    out = make_delta(request, new_ids, is_first)
    out.new_logprobs = logprobs[:len(new_ids)] if logprobs is not None else None
    if is_first and request.wants_prompt_logprobs and request.index == 0:
        out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
    if status is not None:
        out.stop_reason = request.stop_reason
    return out, status
