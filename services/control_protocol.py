"""The control messages of the RL hooks (sleep and wake, weight updates, prefix-cache
reset, collective_rpc), part of the protocol in services/protocol.py.

    API ──ControlRequest──▶ engine core ──WorkerControlOp──▶ worker
    API ◀──ControlReply─── engine core ◀──WorkerControlDone── worker
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ControlRequest:
    """API → engine core: a control verb (``op``: sleep, wake_up, is_sleeping,
    update_weights, reset_prefix_cache, collective_rpc), run between steps once the
    requests it must wait for have ended; answered by ControlReply with the same
    ``request_id`` (engine_core/model_control.py)."""

    request_id: str
    op: str
    level: int = 0  # sleep: 1 frees the KV pool, 2 the weights too
    abort_in_flight: bool = False  # sleep: abort live requests instead of waiting
    path: str = ""  # update_weights: a safetensors file or folder the worker reads
    method: str = ""  # collective_rpc: a method of worker.extension_cls
    args: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class ControlReply:
    """Engine core → API: how a ControlRequest ended. ``code``: "not_enabled",
    "bad_request" (``param`` names the field or the bad tensor) or "failed"."""

    request_id: str
    ok: bool
    message: str = ""
    code: str | None = None
    param: str | None = None
    is_sleeping: bool = False
    result: Any = None  # collective_rpc: what the method returned


@dataclass(slots=True)
class WorkerControlOp:
    """Engine core → worker: run a control verb on the worker's torch thread, between
    steps (worker/worker_control.py); answered by WorkerControlDone."""

    op: str
    level: int = 0
    path: str = ""
    method: str = ""
    args: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class WorkerControlDone:
    """Worker → engine core: the verb ran (``ok``), was refused with nothing changed
    (``tensor``: the bad weight of a refused update) or failed."""

    ok: bool
    message: str = ""
    tensor: str | None = None
    result: Any = None
    code: str | None = None  # "bad_request" (refused, nothing changed) or "failed"
