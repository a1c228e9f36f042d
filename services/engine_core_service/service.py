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
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections import defaultdict

from aiohttp import web

from config.schema import FolioConfig
from engine_core.engine import EngineCore
from engine_core.outputs import EngineCoreOutput, ModelRunnerOutput
from engine_core.sampling_params import InvalidRequestError
from model_files.paths import served_model_name
from observability.logging import get_logger
from services.endpoints import engine_core_endpoint, worker_endpoint
from services.entrypoint import (StopSignal, first_completed, log_ready, run_service,
                                 service_arguments)
from observability.tracing import Tracing
from services.engine_core_service.api_clients import APIClients, send_to_client
from services.engine_core_service.engine_observer import EngineObserver
from services.protocol import (AbortRequest, AddRequest, ExecuteStep, GetMetrics, Health,
                               Metrics, OutputDelta, RequestRejected, StepResult,
                               WorkerReady)
from services.transport import Endpoint, PeerLink, connect, start_site, websocket_route

log = get_logger(__name__)


class WorkerFailure(RuntimeError):
    """The worker died, hung up or reported a failed step: the stack must stop."""


class EngineCoreService:
    """Wraps EngineCore (does not reimplement it); routes deltas to their API client."""

    def __init__(self, config: FolioConfig, worker_endpoint: Endpoint,
                 tracing: Tracing | None = None):
        self.config = config
        self.tracing = tracing
        self.observer: EngineObserver | None = None  # made once the worker is known
        self.worker_endpoint = worker_endpoint
        self.engine: EngineCore | None = None
        self._worker: PeerLink | None = None
        self._worker_session = None
        self._worker_replies: asyncio.Queue = asyncio.Queue()
        self._inbox: list[tuple[PeerLink, object]] = []
        self._wake = asyncio.Event()
        self._owner: dict[str, PeerLink] = {}  # engine req id (sample id) → API link
        self._step_ids = itertools.count()
        self.failure: BaseException | None = None
        self.ready: WorkerReady | None = None
        self.num_steps = 0
        self.last_step_time = time.monotonic()
        self.clients: APIClients | None = None  # made with the engine
        self.step_timeout_s = config.services.step_timeout_s

    async def connect_worker(self, timeout: float = 300.0) -> WorkerReady:
        """Open the worker link and build the EngineCore from its WorkerReady."""
        self._worker, self._worker_session = await connect(self.worker_endpoint, "worker",
                                                           timeout=timeout)
        messages = self._worker.messages()
        ready = await messages.__anext__()
        if not isinstance(ready, WorkerReady):
            raise WorkerFailure(f"worker's first frame was {type(ready).__name__}")
        self.engine = EngineCore.from_model_facts(self.config.scheduler, self.config.cache,
                                                  ready.facts, executor=None)
        self.clients = APIClients(self.engine)
        self._reader = asyncio.get_running_loop().create_task(self._read_worker(messages))
        self.ready = ready
        self.observer = EngineObserver(
            self.config, served_model_name(self.config.model.path,
                                           self.config.model.served_model_name),
            self.tracing)
        log.debug("worker connected", num_blocks=ready.facts.num_blocks,
                  max_model_len=ready.facts.max_model_len)
        return ready

    async def _read_worker(self, messages) -> None:
        async for message in messages:
            await self._worker_replies.put(message)
        await self._worker_replies.put(None)  # the link closed

    async def handle_client(self, link: PeerLink) -> None:
        """One API process: announce the model, then queue its adds and aborts."""
        await link.send(self.ready)
        try:
            await self.clients.join(link)
            async for message in link.messages():
                if isinstance(message, (AddRequest, AbortRequest)):
                    self._inbox.append((link, message))
                    self._wake.set()
                elif isinstance(message, Health):
                    await link.send(Health(self.is_healthy(), self.health_detail()))
                elif isinstance(message, GetMetrics):
                    await link.send(Metrics(self.observer.render_metrics()))
        finally:
            self.clients.leave(link)
        aborted = [r for r, owner in self._owner.items() if owner is link]
        if aborted:  # the API process went away: nobody will read these
            self._inbox.append((link, AbortRequest(aborted)))
            self._wake.set()

    def _seconds_stalled(self) -> float:
        """How long the loop has made no step while there is work (0 when idle)."""
        busy = self.engine.has_unfinished_requests() or bool(self._inbox)
        return time.monotonic() - self.last_step_time if busy else 0.0

    def is_healthy(self) -> bool:
        """Alive and making progress: a live process whose steps stalled is not healthy."""
        return (self.engine is not None and self.failure is None
                and self._seconds_stalled() <= self.step_timeout_s)

    def health_detail(self) -> dict[str, float]:
        """Gauges a probe (or a test) needs to see that the engine is alive and clean:
        after the last request ends, ``num_requests``, ``num_routed_requests`` and
        ``num_referenced_blocks`` (blocks with a reference count above 0) are all 0."""
        stats = self.engine.get_stats()
        pool = self.engine.scheduler.kv_cache_manager.block_pool
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_waiting_tokens": stats.num_waiting_tokens,
                "is_queue_full": float(self.clients.announced_full),
                "num_requests": self.engine.scheduler.get_num_unfinished_requests(),
                "num_routed_requests": len(self._owner),
                "num_free_blocks": pool.num_free_blocks,
                "num_blocks": self.ready.facts.num_blocks - 1,  # block 0 is the null block
                "num_referenced_blocks": sum(b.ref_cnt > 0 for b in pool.blocks),
                "kv_cache_usage": stats.kv_cache_usage, "num_steps": self.num_steps,
                "num_preemptions": stats.num_preemptions, "num_clients": len(self.clients.links),
                "seconds_since_last_step": self._seconds_stalled()}

    async def health(self, request: web.Request) -> web.Response:
        ok = self.is_healthy()
        body = {"status": "ok" if ok else "failed", **(self.health_detail() if ok else {})}
        return web.json_response(body, status=200 if ok else 503)

    async def _apply_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for link, message in inbox:
            if isinstance(message, AbortRequest):
                self.engine.abort_request(message.req_ids)
                continue
            refusal = self.engine.queue_rejection(len(message.prompt_token_ids))
            if refusal is not None:
                await send_to_client(link, RequestRejected(message.req_id, refusal,
                                                           code="queue_full"))
                continue
            try:
                sample_ids = self.engine.add_request(
                    message.req_id, message.prompt_token_ids, message.sampling_params,
                    cache_salt=message.cache_salt, lora_id=message.lora_id,
                    tenant=message.tenant, tenant_weight=message.tenant_weight)
            except InvalidRequestError as e:
                await send_to_client(link, RequestRejected(message.req_id, str(e), e.param))
                continue
            for sample_id in sample_ids:
                self._owner[sample_id] = link
            self.observer.on_add(message, sample_ids)

    async def _execute(self, scheduler_output, traceparent: str | None,
                       request_traceparents: dict[str, str]) -> ModelRunnerOutput:
        step_id = next(self._step_ids)
        await self._worker.send(ExecuteStep(step_id, scheduler_output, traceparent,
                                            request_traceparents))
        try:
            reply = await asyncio.wait_for(self._worker_replies.get(), self.step_timeout_s)
        except asyncio.TimeoutError:
            raise WorkerFailure(f"the worker did not finish step {step_id} within "
                                f"{self.step_timeout_s:g}s (services.step_timeout_s): it "
                                f"is hung") from None
        if reply is None:
            raise WorkerFailure("the worker closed its link")
        if not isinstance(reply, StepResult) or reply.step_id != step_id:
            raise WorkerFailure(f"unexpected worker reply {type(reply).__name__}")
        if reply.error is not None:
            raise WorkerFailure(f"worker step failed: {reply.error}")
        return reply.runner_output

    async def _route(self, outputs: list[EngineCoreOutput]) -> None:
        by_link: dict[PeerLink, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            link = self._owner.get(out.req_id)
            if link is None:
                continue
            by_link[link].append(out)
            if out.finished:
                del self._owner[out.req_id]
        for link, outs in by_link.items():
            await send_to_client(link, OutputDelta(outs))


    async def run(self) -> None:
        """The step loop; returns only by raising WorkerFailure (or cancellation)."""
        try:
            while True:
                if not self._inbox and not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    self.last_step_time = time.monotonic()  # idle time is not a stall
                await self._apply_inbox()
                scheduler_output = self.engine.begin_step()
                traceparents = self.observer.begin_step(scheduler_output)
                runner_output = (await self._execute(scheduler_output, *traceparents)
                                 if self.engine.needs_worker(scheduler_output)
                                 else ModelRunnerOutput())
                outputs = self.engine.end_step(scheduler_output, runner_output)
                self.observer.end_step(scheduler_output, outputs, self.engine)
                await self._route(outputs)
                await self.clients.publish()
                self.num_steps += 1
                self.last_step_time = time.monotonic()
                await asyncio.sleep(0)  # let client handlers queue their messages
        except BaseException as e:
            self.failure = e
            raise

    async def close(self, timeout: float = 1.0) -> None:
        """Close the worker link (the client links close with the site). A hung worker
        never answers the close handshake, so it is not waited for long."""
        try:
            if self._worker is not None:
                await asyncio.wait_for(self._worker.close(), timeout)
        except asyncio.TimeoutError:
            log.info("the worker did not answer the close handshake")
        if self._worker_session is not None:
            await self._worker_session.close()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/ws", websocket_route(self.handle_client, "api"))
        app.router.add_get("/health", self.health)
        return app


async def serve(config: FolioConfig, args: argparse.Namespace, stop: StopSignal) -> int:
    """Connect to the worker, listen for API processes, step until SIGTERM or failure."""
    tracing = Tracing(config.observability, "engine-core")
    core = EngineCoreService(config, worker_endpoint(config.services), tracing)
    await core.connect_worker(timeout=config.services.startup_timeout_s)
    endpoint = engine_core_endpoint(config.services)
    runner = await start_site(core.app(), endpoint, shutdown_timeout=0.5)
    log_ready("engine-core", config, core.ready.facts, endpoint,
              policy=config.scheduler.policy, max_num_seqs=config.scheduler.max_num_seqs)
    stop.mark_serving()
    (loop_task, _), done = await first_completed(core.run(), stop.wait())
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

