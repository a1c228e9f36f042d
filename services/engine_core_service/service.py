"""The engine-core service: EngineCore's step loop between API clients and the worker.

    API processes ──AddRequest/AbortRequest──▶ inbox ─┐
                                                      ▼ (applied between steps)
                          begin_step() ──ExecuteStep──▶ worker
                          end_step()   ◀──StepResult───
    API processes ◀──OutputDelta (per owning client)──┘

Adds and aborts are queued and applied between steps, never while a step is in
flight, so the scheduler only ever sees a consistent world. The loop sleeps when no
request is live and wakes on the next add.

Backpressure: this service is the one authority on the queue limits (every API
process's adds pass through it); it refuses adds past them with RequestRejected
"queue_full" and tells every API process when the queue fills or drains (QueueState).
Watchdog: a step the worker does not answer within ``services.step_timeout_s`` is a
hung worker; the loop fails, /health answers 503 and the process exits 1.
Health: API processes never ask; engine_health.py pushes them snapshots.
Worker: worker_link.py sends steps and control verbs and takes the replies. A step's
outputs are routed to the API processes once the next step is on its way, so routing
overlaps the forward pass. Frames: a step too large for one frame travels in several
(step_frames.py); a request that could never travel is refused when it is added.
LoRA: the engine core is the registry of adapters; engine_lora.py answers the API's
load/unload/list requests and relays load commands and results to and from the worker.
Config: config_reload.py re-reads the YAML (file watch, SIGHUP, an API's ReloadConfig),
applies live keys between steps and sends every API process the running config.
A step that can run nothing while adapters load waits for a wake-up, never spins.
Control: sleep, wake-up, weight updates and prefix-cache resets (engine_control.py)
run between steps, once the requests they must wait for have ended.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections import defaultdict

from aiohttp import web

from config.loader import parse_set_overrides
from config.schema import FolioConfig
from engine_core.engine import EngineCore
from engine_core.lora_registry import UnknownLoRAError
from engine_core.outputs import EngineCoreOutput, ModelRunnerOutput
from engine_core.sampling_params import InvalidRequestError
from model_files.paths import served_model_name
from observability.logging import get_logger
from services.endpoints import engine_core_endpoint, worker_endpoint
from services.entrypoint import (StopSignal, first_completed, log_ready, run_service,
                                 service_arguments)
from observability.tracing import Tracing
from services.engine_core_service.api_clients import APIClients, send_to_client
from services.engine_core_service.engine_control import EngineControl
from services.engine_core_service.config_reload import (ConfigReloader, PendingRetune,
                                                        reload_triggers)
from services.engine_core_service.engine_health import EngineHealth
from services.engine_core_service.engine_lora import EngineLoRA
from services.engine_core_service.engine_observer import EngineObserver
from services.engine_core_service.step_frames import refusal_param
from services.engine_core_service.worker_link import WorkerLink
from services.protocol import (AbortRequest, AddRequest, ControlRequest, GetMetrics,
                               ListLoRAAdapters, LoadLoRAAdapter, Metrics, OutputDelta,
                               ReloadConfig, RequestRejected, UnloadLoRAAdapter, WorkerReady)
from services.transport import Endpoint, PeerLink, start_site, websocket_route

log = get_logger(__name__)


class EngineCoreService:
    """Wraps EngineCore (does not reimplement it); routes deltas to their API client."""

    def __init__(self, config: FolioConfig, worker_endpoint: Endpoint,
                 tracing: Tracing | None = None):
        self.config = config
        self.tracing = tracing
        self.observer: EngineObserver | None = None  # made once the worker is known
        self.worker = WorkerLink(worker_endpoint, config.services.step_timeout_s,
                                 config.services.startup_timeout_s)
        self.engine: EngineCore | None = None
        self.inbox: list[tuple[PeerLink, object]] = []  # adds and aborts between steps
        self._wake = asyncio.Event()
        self.owner: dict[str, PeerLink] = {}  # engine req id (sample id) → API link
        self.failure: BaseException | None = None
        self.ready: WorkerReady | None = None
        self.clients: APIClients | None = None  # made with the engine
        self.lora: EngineLoRA | None = None  # made with the engine
        self.control: EngineControl | None = None  # made with the engine
        self.health = EngineHealth(self)
        self.reloader = None  # a ConfigReloader once serving (live retune)

    async def connect_worker(self, timeout: float = 300.0) -> WorkerReady:
        """Open the worker link and build the EngineCore from its WorkerReady."""
        ready = await self.worker.connect(self._on_lora_result, timeout)
        self.engine = EngineCore.from_model_facts(self.config.scheduler, self.config.cache,
                                                  ready.facts, executor=None,
                                                  lora_config=self.config.lora,
                                                  speculative_config=self.config.speculative)
        self.clients = APIClients(self.engine,
                                  publish_cache=self.config.parallel.data_parallel_size > 1)
        self.lora = EngineLoRA(self.engine)
        self.control = EngineControl(self.engine, self.config.worker, self.health)
        self.ready = ready
        self.observer = EngineObserver(
            self.config, served_model_name(self.config.model.path,
                                           self.config.model.served_model_name),
            self.tracing, ready.facts)
        log.debug("worker connected", num_blocks=ready.facts.num_blocks,
                  max_model_len=ready.facts.max_model_len)
        return ready

    def _on_lora_result(self, result) -> None:
        self.lora.results.append(result)
        self._wake.set()

    async def handle_client(self, link: PeerLink) -> None:
        """One API process: announce the model, then queue its adds and aborts."""
        await link.send(self.ready)
        try:
            await self.clients.join(link)
            await self.health.send_to(link)
            if self.reloader is not None:
                await link.send(self.reloader.update())
            async for message in link.messages():
                if isinstance(message, (AddRequest, AbortRequest, LoadLoRAAdapter,
                                        UnloadLoRAAdapter, ControlRequest)):
                    self.inbox.append((link, message))
                    self._wake.set()
                elif isinstance(message, GetMetrics):
                    await link.send(Metrics(self.observer.render_metrics()))
                elif isinstance(message, ListLoRAAdapters):
                    await link.send(self.lora.list_reply(message))
                elif isinstance(message, ReloadConfig) and self.reloader is not None:
                    self.reloader.answer(link, message)
        finally:
            self.clients.leave(link)
        aborted = [r for r, owner in self.owner.items() if owner is link]
        if aborted:  # the API process went away: nobody will read these
            self.inbox.append((link, AbortRequest(aborted)))
            self._wake.set()

    async def _apply_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for link, message in inbox:
            if isinstance(message, PendingRetune):
                await message.apply(self.worker.ask)
                continue
            if isinstance(message, AbortRequest):
                self.engine.abort_request(message.req_ids)
                continue
            if isinstance(message, (LoadLoRAAdapter, UnloadLoRAAdapter)):
                await self.lora.on_request(link, message)
                continue
            if isinstance(message, ControlRequest):
                await self.control.on_request(link, message)
                continue
            if self.control.holds_adds():  # an update or reset waits for quiet
                self.inbox.append((link, message))
                continue
            refusal = self.engine.queue_rejection(len(message.prompt_token_ids),
                                                  batch_id=message.batch_id)
            if refusal is not None:
                await send_to_client(link, RequestRejected(message.req_id, refusal,
                                                           code="queue_full"))
                continue
            if (param := self._unsendable(message)) is not None:
                await send_to_client(link, RequestRejected(
                    message.req_id, f"the request is too large to reach the model (its "
                    f"{param} would exceed a {self.worker.max_frame_bytes}-byte frame)", param))
                continue
            try:
                sample_ids = self.engine.add_request(
                    message.req_id, message.prompt_token_ids, message.sampling_params,
                    cache_salt=message.cache_salt, lora_id=self.lora.lora_id_of(message.lora_name),
                    tenant=message.tenant, tenant_weight=message.tenant_weight,
                    batch_id=message.batch_id)
            except InvalidRequestError as e:
                code = ("model_not_found" if isinstance(e, UnknownLoRAError)
                        else getattr(e, "code", None))  # "sleeping"
                await send_to_client(link, RequestRejected(message.req_id, str(e), e.param,
                                                           code))
                continue
            for sample_id in sample_ids:
                self.owner[sample_id] = link
            self.observer.on_add(message, sample_ids)

    def _unsendable(self, message: AddRequest) -> str | None:
        facts = self.ready.facts
        return refusal_param(message.req_id, message.sampling_params, facts.max_model_len,
                             facts.block_size, self.worker.max_frame_bytes)

    async def _deliver(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Route a step's outputs and publish what changed; returns the empty list."""
        if outputs:
            await self._route(outputs)
        await self.clients.publish()
        return []

    async def _route(self, outputs: list[EngineCoreOutput]) -> None:
        by_link: dict[PeerLink, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            link = self.owner.get(out.req_id)
            if link is None:
                continue
            by_link[link].append(out)
            if out.finished:
                del self.owner[out.req_id]
        for link, outs in by_link.items():
            await send_to_client(link, OutputDelta(outs))

    async def run(self) -> None:
        """The step loop; returns only by raising WorkerFailure (or cancellation).
        The health publisher runs beside it (and says so when it fails)."""
        publisher = asyncio.get_running_loop().create_task(self.health.publish_forever())
        try:
            is_stalled = False  # the last step ran nothing (requests wait for adapters)
            # A step's outputs go to the API processes once the next step is on its way
            # to the worker, so routing them overlaps its forward pass instead of
            # delaying it (or at once, when no step follows).
            pending: list[EngineCoreOutput] = []
            while True:
                if self._has_nothing_to_do(is_stalled):
                    pending = await self._deliver(pending)
                    # checked again: an add may have come in while delivering, and the
                    # wake-up it set must not be cleared unseen
                    if self._has_nothing_to_do(is_stalled):
                        self._wake.clear()
                        await self._idle(is_stalled)
                await self._apply_inbox()
                await self.control.run_ready(self.worker.ask)
                await self.clients.publish()  # a prefix-cache reset's news goes out now
                await self.lora.apply_results(self.owner)
                scheduler_output = self.engine.begin_step()
                await self.lora.send_commands(self.worker.link)
                traceparents = self.observer.begin_step(scheduler_output)
                is_stalled = not self.engine.needs_worker(scheduler_output)
                step_id = (None if is_stalled else
                           await self.worker.send_step(scheduler_output, *traceparents))
                pending = await self._deliver(pending)
                runner_output = (ModelRunnerOutput() if step_id is None else
                                 await self.worker.step_result(step_id))
                outputs = self.engine.end_step(scheduler_output, runner_output)
                await self.lora.send_commands(self.worker.link)  # evictions of idle adapters
                is_stalled = is_stalled and not outputs
                self.observer.end_step(scheduler_output, outputs, self.engine, runner_output)
                pending = outputs
                self.health.on_step()
                await asyncio.sleep(0)  # let client handlers queue their messages
        except BaseException as e:
            self.failure = e
            raise
        finally:
            publisher.cancel()
            if self.failure is not None and not isinstance(self.failure,
                                                           asyncio.CancelledError):
                await self.health.publish(force=True)  # every API process: 503 now

    def _has_nothing_to_do(self, is_stalled: bool) -> bool:
        return (not self.inbox and not self.lora.results and not self.control.is_ready()
                and (is_stalled or not self.engine.has_unfinished_requests()))

    async def _idle(self, is_stalled: bool) -> None:
        """Sleep until an add, an abort or a load result wakes the loop (stalled on
        loading adapters: at most a second, in case a wake-up was missed)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), 1.0 if is_stalled else None)
        self.health.on_wake()

    async def close(self, timeout: float = 1.0) -> None:
        """Close the worker link (the client links close with the site)."""
        await self.worker.close(timeout)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/ws", websocket_route(self.handle_client, "api"))
        app.router.add_get("/health", self.health.http_health)
        return app


async def serve(config: FolioConfig, args: argparse.Namespace, stop: StopSignal) -> int:
    """Connect to the worker, listen for API processes, step until SIGTERM or failure."""
    tracing = Tracing(config.observability, "engine-core", replica=args.replica)
    core = EngineCoreService(config, worker_endpoint(config.services, args.replica), tracing)
    await core.connect_worker(timeout=config.services.startup_timeout_s)
    endpoint = engine_core_endpoint(config.services, args.replica)
    runner = await start_site(core.app(), endpoint, shutdown_timeout=0.5)
    log_ready("engine-core", config, core.ready.facts, endpoint, replica=args.replica,
              policy=config.scheduler.policy, max_num_seqs=config.scheduler.max_num_seqs)
    core.reloader = ConfigReloader(core, args.config, parse_set_overrides(args.overrides))
    stop.mark_serving()
    (loop_task, *_), done = await first_completed(core.run(), stop.wait(),
                                                  reload_triggers(core.reloader))
    status = 0
    if loop_task in done:
        log.error("engine core stopping: the worker failed", error=str(loop_task.exception()))
        print(f"folio engine-core: {loop_task.exception()}", file=sys.stderr)
        status = 1
    await core.close()
    await runner.cleanup()
    tracing.shutdown()
    return status


def main(argv: list[str] | None = None) -> int:
    return run_service("engine-core", serve,
                       service_arguments("python -m services.engine_core_service"), argv)

