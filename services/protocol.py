"""Every message that crosses a socket between Folio's services, and its wire format.

A frame is one msgpack map ``{"v": PROTOCOL_VERSION, "type": <name>, "body": {...}}``.
Bodies are the interface dataclasses themselves (SchedulerOutput, EngineCoreOutput...),
turned into plain maps field by field and rebuilt from their type hints on decode, so
a field of the wrong type, an unknown field, an unknown message type or another
protocol version is a ProtocolError. Nothing here ever unpickles: a socket that accepts
pickle hands code execution to whoever can write to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from engine_core.kv_events import KVCacheEvents  # engine core → API (data parallelism)
from engine_core.lora_registry import LoRALoad, LoRALoadResult
from engine_core.model_facts import ModelFacts
from engine_core.outputs import EngineCoreOutput, ModelRunnerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler_output import NewRequestData, SchedulerOutput
from services.control_protocol import (ControlReply, ControlRequest, WorkerControlDone,
                                       WorkerControlOp)
from services.wire_codec import ProtocolError, dataclass_from_plain, to_plain  # noqa: F401 (ProtocolError: re-exported)

PROTOCOL_VERSION = 11

# The health snapshot's contract between the engine core (publisher) and every API
# process (reader): pushed at most every PUBLISH interval when it changed and at least
# every HEARTBEAT; one older than MAX_AGE means the engine core went quiet (503).
HEALTH_PUBLISH_INTERVAL_S = 0.1
HEALTH_HEARTBEAT_S = 0.5
HEALTH_MAX_AGE_S = 3.0


@dataclass(slots=True)
class AddRequest:
    """API → engine core: a tokenized request (its samples answer to ``client_id``)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    client_id: str
    arrival_time: float
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter the client named; the engine resolves it
    traceparent: str | None = None
    tenant: str | None = None  # the API key's tenant id (scheduler.policy fair)
    tenant_weight: float = 1.0
    # Each prompt of a multi-prompt request names the request: once an engine core has
    # queued one of them, it queues the others past its queue limits too, so a request
    # is admitted whole (per engine replica), as its n samples are.
    batch_id: str | None = None


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
class LoRAAdapterInfo:
    """One served adapter, as /v1/models lists it."""

    name: str
    lora_id: int


@dataclass(slots=True)
class LoadLoRAAdapter:
    """API → engine core: serve the adapter in ``lora_path`` (already confined to
    lora.allowed_paths) as ``lora_name``; answered by LoRAReply once the worker checked it."""

    request_id: str
    lora_name: str
    lora_path: str


@dataclass(slots=True)
class UnloadLoRAAdapter:
    """API → engine core: stop serving ``lora_name`` (requests using it finish)."""

    request_id: str
    lora_name: str


@dataclass(slots=True)
class ListLoRAAdapters:
    """API → engine core: which adapters are served now (for /v1/models)."""

    request_id: str


@dataclass(slots=True)
class LoRAReply:
    """Engine core → API: the answer to a LoRA request with the same ``request_id``;
    ``code`` "not_found" or "bad_adapter" when it failed (``message`` says why)."""

    request_id: str
    ok: bool
    message: str = ""
    code: str | None = None
    adapters: list[LoRAAdapterInfo] = field(default_factory=list)


@dataclass(slots=True)
class ApplyLoRACommands:
    """Engine core → worker: evict these adapters, then start these loads (each load
    is answered by a LoRALoadFinished when it is done, off the step loop)."""

    evictions: list[int] = field(default_factory=list)
    loads: list[LoRALoad] = field(default_factory=list)


@dataclass(slots=True)
class LoRALoadFinished:
    """Worker → engine core: one load finished or failed."""

    result: LoRALoadResult


@dataclass(slots=True)
class ReloadConfig:
    """API → engine core: re-read the YAML now (POST /admin/reload_config); answered by
    ConfigReloaded with the same ``request_id``."""

    request_id: str


@dataclass(slots=True)
class ConfigReloaded:
    """Engine core → API: how a reload ended. ``result``: "applied", "unchanged",
    "refused" (``refused`` names each restart-only key) or "invalid" (bad YAML or
    value; ``key`` names the key when there is one)."""

    request_id: str
    result: str
    changed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    message: str = ""
    key: str | None = None


@dataclass(slots=True)
class ConfigUpdate:
    """Engine core → API: the stack's running config as JSON (secrets included; the
    link is the services' own). Sent when an API process joins and after every applied
    reload; the API process takes its live keys."""

    config_json: str


@dataclass(slots=True)
class Shutdown:
    """Ask the peer to drain and exit."""

    reason: str = ""


MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    AddRequest, AbortRequest, OutputDelta, RequestRejected, QueueState, ExecuteStep,
    StageNewRequests, StepResult, WorkerReady, Health, HealthSnapshot, GetMetrics, Metrics,
    LoadLoRAAdapter, UnloadLoRAAdapter, ListLoRAAdapters, LoRAReply, ApplyLoRACommands,
    LoRALoadFinished, ControlRequest, ControlReply, WorkerControlOp, WorkerControlDone,
    ReloadConfig, ConfigReloaded, ConfigUpdate, Shutdown, KVCacheEvents)}


def encode(message: Any) -> bytes:
    """One binary frame for ``message`` (an instance of a MESSAGE_TYPES class)."""
    name = type(message).__name__
    if MESSAGE_TYPES.get(name) is not type(message):
        raise TypeError(f"not a protocol message: {type(message)!r}")
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": name, "body": to_plain(message)},
                         use_bin_type=True)


def encoded_size(value: Any) -> int:
    """Bytes ``value`` (a message or a dataclass inside one) takes inside a frame."""
    return len(msgpack.packb(to_plain(value), use_bin_type=True))


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
    return dataclass_from_plain(data["body"], cls, cls.__name__)
