"""The worker service: a ModelRunner behind a WebSocket, one step at a time.

It loads the model and allocates the KV cache at start-up, then announces the pool
with WorkerReady as the first frame of every engine-core link. All torch work runs on
one dedicated thread so the event loop still answers health probes while the forward
pass runs (torch releases the GIL inside its kernels). LoRA adapters load on their own
thread (worker/lora/lora_manager.py); each finished load is reported with a
LoRALoadFinished as soon as it is done, between step results. Evictions and control
verbs (WorkerControlOp: sleep, wake, weight updates, collective_rpc) run between
steps: this handler takes one message at a time. A worker that has run no step for
IDLE_TRIM_SECONDS hands the heap's freed pages back to the OS (worker/heap.py): what a
prefill's temporaries left resident, about 80 MB for a 1B model, costs 2-3 ms to trim,
too much for every step but nothing once the batch has drained.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from config.schema import FolioConfig
from engine_core.outputs import ModelRunnerOutput
from observability.logging import configure_logging, get_logger
from observability.tracing import Tracing, context_from_traceparent
from services.endpoints import worker_endpoint
from services.entrypoint import (StopSignal, first_completed, log_ready, run_service,
                                 service_arguments)
from services.protocol import (ApplyLoRACommands, ExecuteStep, Health, LoRALoadFinished,
                               Shutdown, StageNewRequests, StepResult, WorkerControlDone,
                               WorkerControlOp, WorkerReady, encoded_size)
from services.transport import PeerLink, start_site, websocket_route
from worker.bootstrap import bootstrap_model
from worker.distributed.rank_processes import run_rank
from worker.heap import release_freed_memory, single_arena
from worker.weight_update import WeightUpdateError
from worker.worker_extension import RPCRefused

log = get_logger(__name__)
STOP_FOLLOWERS_S = 5.0
IDLE_TRIM_SECONDS = 1.0


class WorkerService:
    """Owns one ModelRunner; serves ExecuteStep (and its StageNewRequests), Health and
    Shutdown."""

    def __init__(self, config: FolioConfig, tracing: Tracing | None = None):
        # Every torch call runs on this one thread, model load included: OpenMP keeps a
        # thread team per calling thread, and a second team fighting the first one's
        # spinning workers made decode steps ~1.7x slower on 2 cores.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-step")
        # copy_context: the thread's log lines keep the service's bound fields
        loaded = self._pool.submit(contextvars.copy_context().run, bootstrap_model,
                                   config, False).result()
        self.runner = loaded.runner
        self.control = loaded.control
        self.num_blocks = loaded.facts.num_blocks
        self.ready = WorkerReady(loaded.facts)
        self.tracer = tracing.tracer if tracing is not None else None
        self.tp_size = config.parallel.tensor_parallel_size
        self.shutdown_requested = asyncio.Event()
        self.num_steps = 0
        # New requests staged for a step too large for one frame, until its ExecuteStep.
        self._staged: dict[int, list] = {}
        self._reports: set[asyncio.Task] = set()  # LoRALoadFinished frames being sent
        self._idle_trim: asyncio.TimerHandle | None = None  # armed by every step
        self.num_idle_trims = 0

    async def handle(self, link: PeerLink) -> None:
        """Serve one engine-core link until it closes."""
        await link.send(self.ready)
        loop = asyncio.get_running_loop()
        async for message in link.messages():
            if isinstance(message, StageNewRequests):
                self._staged.setdefault(message.step_id, []).extend(message.new_reqs)
            elif isinstance(message, ExecuteStep):
                message = self._unstage(message)
                reply = (message if isinstance(message, StepResult) else
                         await loop.run_in_executor(self._pool, self._execute, message))
                await link.send(reply)
                self._arm_idle_trim(loop)
            elif isinstance(message, ApplyLoRACommands):
                self._apply_lora(link, message)
            elif isinstance(message, WorkerControlOp):
                # in this context: its log lines carry service=worker
                await link.send(await loop.run_in_executor(
                    self._pool, contextvars.copy_context().run, self._control, message))
            elif isinstance(message, Health):
                await link.send(Health(True, {"steps": str(self.num_steps)}))
            elif isinstance(message, Shutdown):
                log.info("shutdown requested", reason=message.reason)
                self.shutdown_requested.set()
                return
            else:
                log.warning("unexpected message for the worker", type=type(message).__name__)

    def _arm_idle_trim(self, loop: asyncio.AbstractEventLoop) -> None:
        """Trim the heap once no step has come for IDLE_TRIM_SECONDS (the model thread
        runs it, so it never overlaps a step)."""
        if self._idle_trim is not None:
            self._idle_trim.cancel()
        self._idle_trim = loop.call_later(IDLE_TRIM_SECONDS, self._trim_when_idle)

    def _trim_when_idle(self) -> None:
        self._idle_trim = None
        with contextlib.suppress(RuntimeError):  # the pool is shutting down
            self._pool.submit(release_freed_memory)
            self.num_idle_trims += 1

    def _apply_lora(self, link: PeerLink, message: ApplyLoRACommands) -> None:
        lora = self.runner.lora
        if lora is None:
            log.warning("LoRA commands for a worker without LoRA (lora.enable_lora)")
            return
        loop = asyncio.get_running_loop()

        async def send(result) -> None:
            with contextlib.suppress(ConnectionError, RuntimeError):  # engine core gone
                await link.send(LoRALoadFinished(result))

        def report(result) -> None:  # on the loader thread: hand over to the event loop
            def start() -> None:
                task = loop.create_task(send(result))
                self._reports.add(task)  # held until sent
                task.add_done_callback(self._reports.discard)
            loop.call_soon_threadsafe(start)

        for lora_id in message.evictions:
            lora.evict(lora_id)
        for load in message.loads:
            lora.start_load(load, report)

    def _control(self, message: WorkerControlOp) -> WorkerControlDone:
        """Run one control verb (on the torch thread); a refusal changes nothing."""
        c = self.control
        try:
            if message.op == "sleep":
                c.sleep(message.level)
            elif message.op == "wake_up":
                c.wake_up()
            elif message.op == "update_weights":
                return WorkerControlDone(True, f"{c.update_weights(message.path)} tensors "
                                         f"updated")
            elif message.op == "set_log_level":  # a live retune of observability
                configure_logging(*message.args)
                log.debug("log level set", log_level=message.args[0])  # seen only at debug
            elif message.op == "collective_rpc":
                result = c.collective_rpc(message.method, message.args)
                try:
                    encoded_size(result)
                except (TypeError, ValueError):
                    return WorkerControlDone(False, f"{message.method} returned a "
                                             f"{type(result).__name__}, which cannot travel "
                                             f"(msgpack values only)", code="failed")
                return WorkerControlDone(True, result=result)
            else:
                return WorkerControlDone(False, f"unknown control verb {message.op!r}",
                                         code="bad_request")
        except WeightUpdateError as e:
            return WorkerControlDone(False, str(e), tensor=e.tensor, code="bad_request")
        except (RPCRefused, ValueError) as e:
            return WorkerControlDone(False, str(e), code="bad_request")
        except Exception as e:  # reported; the engine core answers the caller with it
            log.error("control verb failed", op=message.op, error=repr(e),
                      traceback=traceback.format_exc())
            return WorkerControlDone(False, f"{message.op} failed: {e!r}", code="failed")
        return WorkerControlDone(True)

    def _unstage(self, message: ExecuteStep) -> ExecuteStep | StepResult:
        """The step with its staged new requests back in front (an error StepResult if
        they did not all arrive). Staged data never outlives its step."""
        staged = self._staged.pop(message.step_id, [])
        self._staged.clear()
        if len(staged) != message.num_staged_new_reqs:
            return StepResult(message.step_id, ModelRunnerOutput(), error=(
                f"step {message.step_id}: {len(staged)} staged new requests, expected "
                f"{message.num_staged_new_reqs}"))
        if staged:
            so = message.scheduler_output
            so.scheduled_new_reqs = staged + so.scheduled_new_reqs
        return message

    def _execute(self, message: ExecuteStep) -> StepResult:
        start_ns = time.time_ns()
        try:
            output = self.runner.execute_model(message.scheduler_output, message.traceparent)
        except Exception as e:  # reported to the engine core, which fails loudly
            log.error("step failed", step_id=message.step_id, error=repr(e),
                      traceback=traceback.format_exc())
            return StepResult(message.step_id, ModelRunnerOutput(), error=repr(e))
        self.num_steps += 1
        if self.tracer is not None and (message.traceparent or message.request_traceparents):
            self._trace_step(message, start_ns, time.time_ns())
        return StepResult(message.step_id, output)

    def _trace_step(self, message: ExecuteStep, start_ns: int, end_ns: int) -> None:
        """worker.execute under the engine-step span; worker.add_request under the engine
        span of each request whose state this step created."""
        so, timing = message.scheduler_output, self.runner.last_timing
        if message.traceparent:
            self.tracer.start_span(
                "worker.execute", context=context_from_traceparent(message.traceparent),
                start_time=start_ns, attributes={
                    "folio.step_id": message.step_id,
                    "folio.batch_size": len(so.num_scheduled_tokens),
                    "folio.num_tokens": so.total_num_scheduled_tokens,
                    "folio.num_new_requests": len(so.scheduled_new_reqs),
                    "folio.prepare_seconds": timing.prepare_seconds,
                    "folio.forward_seconds": timing.forward_seconds,
                    "folio.sample_seconds": timing.sample_seconds,
                    # rank 0's; the other ranks send their own (follower.py)
                    "folio.rank": 0,
                    "folio.tensor_parallel_size": self.tp_size}).end(end_time=end_ns)
        prepared_ns = start_ns + int(timing.prepare_seconds * 1e9)
        new = {r.req_id: r for r in so.scheduled_new_reqs}
        for req_id, traceparent in message.request_traceparents.items():
            data = new.get(req_id)
            attributes = {"folio.request_id": req_id, "folio.step_id": message.step_id}
            if data is not None:
                attributes.update({"folio.num_tokens": len(data.token_ids),
                                   "folio.num_blocks": len(data.block_ids),
                                   "folio.is_resumed": data.num_output_tokens > 0})
            self.tracer.start_span("worker.add_request",
                                   context=context_from_traceparent(traceparent),
                                   start_time=start_ns,
                                   attributes=attributes).end(end_time=prepared_ns)

    async def stop_followers(self) -> None:
        """Tensor parallelism: tell the other ranks to leave (after the last step). A
        rank already gone is not waited for: the launcher is stopping the stack."""
        if self.runner.channel is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._pool,
                                                        self.runner.stop_followers),
                                   STOP_FOLLOWERS_S)
        except (asyncio.TimeoutError, RuntimeError) as e:
            log.warning("could not stop the other tensor-parallel ranks", error=repr(e))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "num_steps": self.num_steps,
                                  "num_blocks": self.num_blocks,
                                  "sleep_level": self.control.sleep_mode.level})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/ws", websocket_route(self.handle, "engine-core"))
        app.router.add_get("/health", self.health)
        return app


async def serve(config: FolioConfig, args: argparse.Namespace, stop: StopSignal) -> int:
    """Load the model, listen, and serve until SIGTERM or a Shutdown message."""
    t0 = time.perf_counter()
    tracing = Tracing(config.observability, "worker", replica=args.replica)
    worker = WorkerService(config, tracing)
    endpoint = worker_endpoint(config.services, args.replica)
    runner = await start_site(worker.app(), endpoint)
    log_ready("worker", config, worker.ready.facts, endpoint, replica=args.replica,
              attention_backend=worker.runner.attention_backend.name,
              load_seconds=round(worker.runner.load_seconds, 2),
              ready_seconds=round(time.perf_counter() - t0, 2))
    stop.mark_serving()
    await first_completed(stop.wait(), worker.shutdown_requested.wait())
    await runner.cleanup()
    await worker.stop_followers()
    tracing.shutdown()
    return 0


async def serve_rank(config: FolioConfig, rank: int, stop: StopSignal) -> int:
    """A tensor-parallel rank other than 0: no socket, only its share of each step
    (worker/distributed/follower.py). It runs on a daemon thread: a rank blocked in a
    collective when SIGTERM comes must not hold the process open."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def finish(status: int) -> None:
        if not done.done():
            done.set_result(status)

    def run() -> None:
        try:
            status = run_rank(config, rank)
        except Exception as e:  # rank 0 (or another rank) went away mid-collective
            log.error("tensor-parallel rank failed", rank=rank, error=repr(e))
            status = 1
        loop.call_soon_threadsafe(finish, status)

    threading.Thread(target=run, name=f"folio-tp-rank-{rank}", daemon=True).start()
    stop.mark_serving()
    await first_completed(stop.wait(), done)
    return done.result() if done.done() else 0


async def serve_any(config: FolioConfig, args: argparse.Namespace, stop: StopSignal) -> int:
    if args.rank:
        return await serve_rank(config, args.rank, stop)
    return await serve(config, args, stop)


def main(argv: list[str] | None = None) -> int:
    single_arena()  # before any thread allocates (worker/heap.py)
    parser = service_arguments("python -m services.worker_service")
    parser.add_argument("--rank", type=int, default=0,
                        help="tensor-parallel rank (0: the worker the engine core talks to)")
    return run_service("worker", serve_any, parser, argv)

