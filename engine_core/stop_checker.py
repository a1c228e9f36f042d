"""The token-level stop rules applied after each sampled token.

Stop strings are not checked here: they need detokenized text, which the API layer
owns; it finishes the request through ``Scheduler.finish_requests``.
"""
from __future__ import annotations

from engine_core.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int,
               grammar_ended: bool = False) -> RequestStatus | None:
    """The finished status ``request`` reaches with ``token_id`` (already appended).

    Order: an EOS where the grammar allowed nothing else (``grammar_ended``: whatever
    ``ignore_eos`` and ``min_tokens`` say, the output cannot go on), a stop token id
    (recorded as ``stop_reason``), then EOS unless ``ignore_eos`` (neither before
    ``min_tokens`` outputs), then the length limits.
    """
    params = request.sampling_params
    if grammar_ended and token_id in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_until_stop(request: Request, token_ids: list[int], max_model_len: int,
                      grammar_ended: bool = False) -> tuple[list[int], RequestStatus | None]:
    """Append sampled tokens one by one until a stop rule fires.

    Returns the tokens appended (those after a stop are dropped) and the finished
    status reached, if any; the caller finishes the request.
    """
    new_ids: list[int] = []
    for token_id in token_ids:
        request.append_output_token_ids(token_id)
        new_ids.append(token_id)
        status = check_stop(request, token_id, max_model_len, grammar_ended)
        if status is not None:
            return new_ids, status
    return new_ids, None
