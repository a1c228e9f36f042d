"""Every message that crosses a socket between Folio's services, and its wire format.

A frame is one msgpack map ``{"v": PROTOCOL_VERSION, "type": <name>, "body": {...}}``.
Bodies are the interface dataclasses themselves (SchedulerOutput, EngineCoreOutput...),
turned into plain maps field by field and rebuilt from their type hints on decode, so
a field of the wrong type, an unknown field, an unknown message type or another
protocol version is a ProtocolError. Nothing here ever unpickles: a socket that accepts
pickle hands code execution to whoever can write to it.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgpack

from engine_core.model_facts import ModelFacts
from engine_core.outputs import EngineCoreOutput, ModelRunnerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler_output import NewRequestData, SchedulerOutput

PROTOCOL_VERSION = 6

# The health snapshot's contract between the engine core (publisher) and every API
# process (reader): pushed at most every PUBLISH interval when it changed and at least
# every HEARTBEAT; one older than MAX_AGE means the engine core went quiet (503).
HEALTH_PUBLISH_INTERVAL_S = 0.1
HEALTH_HEARTBEAT_S = 0.5
HEALTH_MAX_AGE_S = 3.0


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


@dataclass(slots=True)
class AddRequest:
    """API → engine core: a tokenized request (its samples answer to ``client_id``)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    client_id: str
    arrival_time: float
    cache_salt: str | None = None
    lora_id: int = 0
    traceparent: str | None = None
    tenant: str | None = None  # the API key's tenant id (scheduler.policy fair)
    tenant_weight: float = 1.0


@dataclass(slots=True)
class AbortRequest:
    """API → engine core: stop these requests (client gone, stop string matched)."""

    req_ids: list[str]


@dataclass(slots=True)
class OutputDelta:
    """Engine core → API: one step's new tokens for requests this client owns."""

    outputs: list[EngineCoreOutput]


@dataclass(slots=True)
class ExecuteStep:
    """Engine core → worker: one step's plan (diffs only).

    ``traceparent`` names the engine-step span when the step is traced;
    ``request_traceparents`` the engine span of each traced request the worker sees
    for the first time (new, or resumed after preemption). ``num_staged_new_reqs``:
    that many new requests came ahead in StageNewRequests frames of this step; they
    go first among ``scheduler_output.scheduled_new_reqs``."""

    step_id: int
    scheduler_output: SchedulerOutput
    traceparent: str | None = None
    request_traceparents: dict[str, str] = field(default_factory=dict)
    num_staged_new_reqs: int = 0


@dataclass(slots=True)
class StageNewRequests:
    """Engine core → worker: new requests of step ``step_id`` sent ahead of its
    ExecuteStep because one frame would exceed the transport's limit (see
    services/engine_core_service/step_frames.py). The worker keeps them for that step."""

    step_id: int
    new_reqs: list[NewRequestData]


@dataclass(slots=True)
class StepResult:
    """Worker → engine core: what the step sampled."""

    step_id: int
    runner_output: ModelRunnerOutput
    error: str | None = None


@dataclass(slots=True)
class RequestRejected:
    """Engine core → API: a request failed validation (``param`` names the field), or
    ``code`` "queue_full": the engine is at its queue limits (the client gets 503)."""

    req_id: str
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(slots=True)
class QueueState:
    """Engine core → every API process, whenever ``is_full`` flips (and on connect):
    while it is true API processes refuse new requests before tokenizing them."""

    is_full: bool
    num_waiting: int = 0
    num_waiting_tokens: int = 0


@dataclass(slots=True)
class WorkerReady:
    """First frame on a link, worker → engine core and engine core → API: the KV pool
    and the model's limits."""

    facts: ModelFacts


@dataclass(slots=True)
class Health:
    """Either direction: liveness probe and its answer (``detail``: counters and gauges)."""

    ok: bool = True
    detail: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class HealthSnapshot:
    """Engine core → every API process: whether it serves (``ok``: alive and making
    progress) and its gauges. Pushed, never asked for: an API process answers /health
    from the latest one, so a probe costs the engine core nothing (timing above)."""

    ok: bool
    detail: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class GetMetrics:
    """API → engine core: ask for the Prometheus text of the engine's metrics."""


@dataclass(slots=True)
class Metrics:
    """Engine core → API: Prometheus text exposition of every engine-side metric."""

    text: str


@dataclass(slots=True)
class Shutdown:
    """Ask the peer to drain and exit."""

    reason: str = ""


MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    AddRequest, AbortRequest, OutputDelta, RequestRejected, QueueState, ExecuteStep,
    StageNewRequests, StepResult, WorkerReady, Health, HealthSnapshot, GetMetrics, Metrics,
    Shutdown)}
# Items msgpack builds itself: a list of only these converts in one C pass, not a
# Python call per element (a step's token ids, a request's stop token ids).
_PLAIN_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, set, frozenset)):
        if set(map(type, value)) <= _PLAIN_SCALARS:
            return value if type(value) is list else list(value)
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):  # msgpack maps take string keys: ints travel as text
        return {str(k) if type(k) is int else k: _to_plain(v) for k, v in value.items()}
    return value


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_plain(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _from_plain(value, arg, where)
            except ProtocolError:
                pass
        raise ProtocolError(f"{where}: {value!r} matches none of {tp}")
    if origin in (list, set, frozenset, tuple):  # tuple[X, ...]: args[0] is X
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        if args[0] in (int, str) and set(map(type, value)) <= {args[0]}:
            items = value  # checked in one C pass (a bool is not an int)
        else:
            items = [_from_plain(v, args[0], f"{where}[]") for v in value]
        return items if origin is list else origin(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map")
        return {_key(k, args[0], where): _from_plain(v, args[1], f"{where}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _dataclass_from_plain(value, tp, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ProtocolError(f"{where}: {value!r} is not a {tp.__name__}") from None
    return _scalar(value, tp, where)


def _key(key: Any, tp: Any, where: str) -> Any:
    """A map key: an ``int`` key arrives as its decimal text (see ``_to_plain``)."""
    if tp is int and isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ProtocolError(f"{where}: key {key[:20]!r} is not an integer") from None
    return _from_plain(key, tp, where)


def _scalar(value: Any, tp: type, where: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _dataclass_from_plain(value: Any, cls: type, where: str) -> Any:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected a map for {cls.__name__}")
    hints = _hints(cls)
    unknown = set(value) - set(hints)
    if unknown:
        raise ProtocolError(f"{where}: unknown fields {sorted(unknown)} for {cls.__name__}")
    kwargs = {name: _from_plain(v, hints[name], f"{where}.{name}") for name, v in value.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # missing fields, or SamplingParams validation
        raise ProtocolError(f"{where}: {e}") from None


def encode(message: Any) -> bytes:
    """One binary frame for ``message`` (an instance of a MESSAGE_TYPES class)."""
    name = type(message).__name__
    if MESSAGE_TYPES.get(name) is not type(message):
        raise TypeError(f"not a protocol message: {type(message)!r}")
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": name, "body": _to_plain(message)},
                         use_bin_type=True)


def encoded_size(value: Any) -> int:
    """Bytes ``value`` (a message or a dataclass inside one) takes inside a frame."""
    return len(msgpack.packb(_to_plain(value), use_bin_type=True))


def decode(frame: bytes) -> Any:
    """The message in ``frame``; ProtocolError if it is not a valid one."""
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None
    if not isinstance(data, dict) or set(data) != {"v", "type", "body"}:
        raise ProtocolError("a frame is a map with exactly v, type and body")
    if data["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {data['v']!r} != {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(data["type"]) if isinstance(data["type"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {data['type']!r}")
    return _dataclass_from_plain(data["body"], cls, cls.__name__)
