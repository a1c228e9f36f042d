"""One step's frames to the worker, every one within the transport's frame limit.

    common case   ExecuteStep                         encoded once; only its length checked
    too large     StageNewRequests(step, chunk) x k   the new requests' data, packed
                  ExecuteStep(num_staged_new_reqs=N)  the rest of the plan

The worker keeps staged requests until the ExecuteStep of the same step and puts them
back in front of that step's new requests, in order, so the runner sees exactly the
SchedulerOutput the scheduler built. Everything but new requests' data is small (ids of
at most MAX_REQ_ID_CHARS, block ids, counts); new requests' data each fit a frame of
their own, because the engine core refuses at add time a request whose bound
(``new_request_bytes_bound``) does not leave FRAME_HEADROOM_BYTES.
"""
from __future__ import annotations

import dataclasses

from engine_core.engine import MAX_REQ_ID_CHARS
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler_output import NewRequestData
from services.protocol import ExecuteStep, StageNewRequests, encode, encoded_size

# Room for a StageNewRequests frame's envelope (tens of bytes), with a wide margin: a
# chunk of staged requests gets the limit minus this.
FRAME_HEADROOM_BYTES = 64 * 1024
_MAX_INT_BYTES = 9  # msgpack's widest integer
_FIXED_FIELDS_BYTES = 1024  # field names, counts and scalar sampler settings


class StepTooLarge(RuntimeError):
    """A single new request's data exceeds a frame: the add-time bound was wrong."""


def new_request_bytes_bound(req_id: str, params: SamplingParams, max_model_len: int,
                            block_size: int) -> int:
    """An upper bound on any NewRequestData one sample of this request produces: its
    token ids (prompt plus outputs, resumed or not) and block ids are bounded by
    ``max_model_len``; the worker's stop token ids travel only with ``min_tokens``."""
    num_ints = max_model_len + -(-max_model_len // block_size)
    if params.min_tokens > 0:
        num_ints += len(params.stop_token_ids)
    sample_id_bytes = 4 * (len(req_id) + len(str(params.n)) + 1)  # "{i}_{req_id}", UTF-8
    return _FIXED_FIELDS_BYTES + sample_id_bytes + _MAX_INT_BYTES * num_ints


def refusal_param(req_id: str, params: SamplingParams, max_model_len: int, block_size: int,
                  max_frame_bytes: int) -> str | None:
    """The field to name when the request could not travel to the worker, else None."""
    if len(req_id) > MAX_REQ_ID_CHARS:
        return None  # EngineCore.add_request refuses it, naming req_id
    bound = new_request_bytes_bound(req_id, params, max_model_len, block_size)
    if bound <= max_frame_bytes - FRAME_HEADROOM_BYTES:
        return None
    return "stop_token_ids" if params.min_tokens > 0 and params.stop_token_ids else "prompt"


def step_frames(message: ExecuteStep, max_frame_bytes: int) -> list[bytes]:
    """The frames that carry ``message`` to the worker, in order (usually one)."""
    frame = encode(message)
    if len(frame) <= max_frame_bytes:
        return [frame]
    so = message.scheduler_output
    chunks = _chunks(so.scheduled_new_reqs, max_frame_bytes - FRAME_HEADROOM_BYTES)
    rest = dataclasses.replace(message, num_staged_new_reqs=len(so.scheduled_new_reqs),
                               scheduler_output=dataclasses.replace(so, scheduled_new_reqs=[]))
    frames = [encode(StageNewRequests(message.step_id, chunk)) for chunk in chunks]
    frames.append(encode(rest))
    if max(map(len, frames)) > max_frame_bytes:
        raise StepTooLarge(f"step {message.step_id} does not fit frames of "
                           f"{max_frame_bytes} bytes even when split")
    return frames


def _chunks(new_reqs: list[NewRequestData], budget: int) -> list[list[NewRequestData]]:
    """Consecutive runs of ``new_reqs`` whose encoded sizes add up to at most ``budget``."""
    chunks: list[list[NewRequestData]] = [[]]
    used = 0
    for new in new_reqs:
        size = encoded_size(new)
        if size > budget:
            raise StepTooLarge(f"request {new.req_id}'s data takes {size} bytes, more "
                               f"than a frame's {budget}")
        if used + size > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(new)
        used += size
    return [chunk for chunk in chunks if chunk]
