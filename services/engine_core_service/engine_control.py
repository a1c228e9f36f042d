"""The engine-core service's control traffic (RL hooks), between the step loop's steps.

    API ──ControlRequest──▶ here: queued ─(its requests ended)─▶ WorkerControlOp ──▶ worker
    API ◀──ControlReply─── here ◀──────────── WorkerControlDone ─────────────────── worker

Verbs run in arrival order. ``sleep``, ``update_weights`` and ``reset_prefix_cache``
wait until no request is live (engine_core/model_control.py): a sleep refuses new
requests from the moment it is asked ("sleeping", 503) and, with
``abort_in_flight``, aborts the live ones at once; an update or a reset holds new
requests back in the inbox until it is done, so none is lost and none runs on a mix
of weights. ``is_sleeping`` is answered at once; ``wake_up`` and ``collective_rpc``
need no quiet. A verb whose YAML switch is off is refused without reaching the worker.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from config.schema import WorkerConfig
from engine_core.engine import EngineCore
from observability.logging import get_logger
from services.engine_core_service.api_clients import send_to_client
from services.protocol import ControlReply, ControlRequest, WorkerControlDone, WorkerControlOp
from services.transport import PeerLink

if TYPE_CHECKING:
    from services.engine_core_service.engine_health import EngineHealth

log = get_logger("services.engine_core")

QUIET_OPS = frozenset({"sleep", "update_weights", "reset_prefix_cache"})
HOLDING_OPS = frozenset({"update_weights", "reset_prefix_cache"})  # adds wait, not refused
OPS = QUIET_OPS | {"wake_up", "is_sleeping", "collective_rpc"}

AskWorker = Callable[[WorkerControlOp], Awaitable[WorkerControlDone]]


class EngineControl:
    """Queues the API's control verbs and runs each when the engine allows it."""

    def __init__(self, engine: EngineCore, config: WorkerConfig, health: EngineHealth):
        self.engine = engine
        self.control = engine.control
        self.config = config
        self.health = health
        self.pending: deque[tuple[PeerLink, ControlRequest]] = deque()

    def _disabled(self, message: ControlRequest) -> str | None:
        """Why the YAML forbids this verb, or None."""
        if message.op in ("sleep", "wake_up") and not self.config.enable_sleep_mode:
            return "sleep mode is off (worker.enable_sleep_mode)"
        if message.op == "update_weights" and not self.config.enable_weight_updates:
            return "weight updates are off (worker.enable_weight_updates)"
        if message.op == "collective_rpc" and not self.config.extension_cls:
            return "no worker extension is declared (worker.extension_cls)"
        return None

    async def on_request(self, link: PeerLink, message: ControlRequest) -> None:
        """Answer at once what needs no worker, queue the rest."""
        if message.op not in OPS:
            await self._reply(link, message, False, f"unknown control verb {message.op!r}",
                              "bad_request", "op")
            return
        if (why := self._disabled(message)) is not None:
            await self._reply(link, message, False, why, "not_enabled")
            return
        if message.op == "is_sleeping":
            await self._reply(link, message, True)
            return
        if message.op == "sleep":
            if message.level not in (1, 2):
                await self._reply(link, message, False, "level must be 1 or 2",
                                  "bad_request", "level")
                return
            if not self.control.is_sleeping:
                self.control.is_sleep_pending = True  # new requests are refused from now
                if message.abort_in_flight:
                    aborted = self.control.abort_in_flight()
                    log.info("sleep aborts requests in flight", num_requests=len(aborted))
        self.pending.append((link, message))

    def holds_adds(self) -> bool:
        """Whether new requests must wait in the inbox (an update or reset is queued)."""
        return any(m.op in HOLDING_OPS for _, m in self.pending)

    def is_ready(self) -> bool:
        """Whether the first queued verb may run now."""
        if not self.pending:
            return False
        return self.pending[0][1].op not in QUIET_OPS or self.control.is_quiet()

    async def run_ready(self, ask_worker: AskWorker) -> None:
        """Run queued verbs while they may run, answering each."""
        while self.is_ready():
            link, message = self.pending.popleft()
            await self._run(link, message, ask_worker)

    async def _run(self, link: PeerLink, message: ControlRequest,
                   ask_worker: AskWorker) -> None:
        op, control = message.op, self.control
        if op == "reset_prefix_cache":
            control.forget_prefixes()
            await self._reply(link, message, True)
            return
        if (op == "sleep" and control.is_sleeping) or (op == "wake_up"
                                                       and not control.is_sleeping):
            await self._reply(link, message, True)  # already so
            return
        done = await ask_worker(WorkerControlOp(op, message.level, message.path,
                                                message.method, list(message.args)))
        if done.ok:
            if op == "sleep":
                control.on_sleep(message.level)
            elif op == "wake_up":
                control.on_wake()
            elif op == "update_weights":
                control.on_weights_updated()
            log.info("control verb done", op=op, level=message.level or None)
        elif op == "sleep":
            control.is_sleep_pending = False
        await self.health.publish(force=True)  # API processes see the new state first
        await self._reply(link, message, done.ok, done.message, done.code,
                          done.tensor or ("path" if op == "update_weights" else None),
                          done.result)

    async def _reply(self, link: PeerLink, message: ControlRequest, ok: bool,
                     text: str = "", code: str | None = None, param: str | None = None,
                     result=None) -> None:
        await send_to_client(link, ControlReply(
            message.request_id, ok, text, code if not ok else None,
            param if not ok else None, self.control.is_sleeping or
            self.control.is_sleep_pending, result))
