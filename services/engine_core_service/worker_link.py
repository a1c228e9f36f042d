"""The engine core's one link to the worker: steps out and their results back, control
verbs between steps, and LoRA load results whenever they arrive.

A reader task takes every frame the worker sends: a LoRALoadFinished goes to the
callback at once (loads finish between step results); everything else is a reply,
queued for the one caller waiting on it (worker_replies.py: a reply that does not come
within its timeout is a hung worker, a closed link a dead one).
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Callable

from engine_core.outputs import ModelRunnerOutput
from observability.logging import get_logger
from services.engine_core_service.step_frames import step_frames
from services.engine_core_service.worker_replies import WorkerFailure, next_worker_reply
from services.protocol import (ExecuteStep, LoRALoadFinished, StepResult, WorkerControlDone,
                               WorkerControlOp, WorkerReady)
from services.transport import MAX_FRAME_BYTES, Endpoint, PeerLink, connect

log = get_logger(__name__)


class WorkerLink:
    """The link to the worker service, once :meth:`connect` has opened it."""

    def __init__(self, endpoint: Endpoint, step_timeout_s: float, startup_timeout_s: float):
        self.endpoint = endpoint
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.link: PeerLink | None = None
        self._session = None
        self._replies: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._step_ids = itertools.count()
        self.max_frame_bytes = MAX_FRAME_BYTES  # what the worker accepts in one frame
        self.num_split_steps = 0  # steps that needed more than one frame

    async def connect(self, on_lora_result: Callable[[object], None],
                      timeout: float) -> WorkerReady:
        """Open the link; returns the worker's WorkerReady (its first frame)."""
        self.link, self._session = await connect(self.endpoint, "worker", timeout=timeout)
        messages = self.link.messages()
        ready = await messages.__anext__()
        if not isinstance(ready, WorkerReady):
            raise WorkerFailure(f"worker's first frame was {type(ready).__name__}")
        self._reader = asyncio.get_running_loop().create_task(
            self._read(messages, on_lora_result))
        return ready

    async def _read(self, messages, on_lora_result) -> None:
        async for message in messages:
            if isinstance(message, LoRALoadFinished):
                on_lora_result(message.result)
                continue
            await self._replies.put(message)
        await self._replies.put(None)  # the link closed

    async def send_step(self, scheduler_output, traceparent: str | None,
                        request_traceparents: dict[str, str]) -> int:
        """Send one step (in several frames if it must); returns its id."""
        step_id = next(self._step_ids)
        frames = step_frames(ExecuteStep(step_id, scheduler_output, traceparent,
                                         request_traceparents), self.max_frame_bytes)
        self.num_split_steps += len(frames) > 1
        for frame in frames:
            await self.link.send_frame(frame)
        return step_id

    async def step_result(self, step_id: int) -> ModelRunnerOutput:
        """The worker's answer to step ``step_id`` (WorkerFailure if it failed)."""
        reply = await next_worker_reply(self._replies, StepResult, f"step {step_id}",
                                        self.step_timeout_s, "services.step_timeout_s")
        if reply.step_id != step_id:
            raise WorkerFailure(f"worker answered step {reply.step_id}, not {step_id}")
        if reply.error is not None:
            raise WorkerFailure(f"worker step failed: {reply.error}")
        return reply.runner_output

    async def ask(self, op: WorkerControlOp) -> WorkerControlDone:
        """One control verb, between steps (a level-2 wake reloads the weights: it may
        take as long as start-up did)."""
        await self.link.send(op)
        timeout = max(self.step_timeout_s, self.startup_timeout_s)
        return await next_worker_reply(self._replies, WorkerControlDone, op.op, timeout,
                                       "services.startup_timeout_s")

    async def close(self, timeout: float = 1.0) -> None:
        """Close the link. A hung worker never answers the close handshake, so it is
        not waited for long."""
        try:
            if self.link is not None:
                await asyncio.wait_for(self.link.close(), timeout)
        except asyncio.TimeoutError:
            log.info("the worker did not answer the close handshake")
        if self._session is not None:
            await self._session.close()
