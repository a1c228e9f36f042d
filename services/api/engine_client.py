"""The API process's link to the engine core: send requests, receive their deltas."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque

from engine_core.kv_events import KVCacheEvents
from engine_core.model_facts import ModelFacts
from engine_core.sampling_params import SamplingParams
from services.protocol import (HEALTH_MAX_AGE_S, AbortRequest, AddRequest, ConfigReloaded,
                               ConfigUpdate, ControlReply, ControlRequest, GetMetrics,
                               HealthSnapshot, ListLoRAAdapters, LoadLoRAAdapter, LoRAReply,
                               Metrics, OutputDelta, ProtocolError, QueueState,
                               ReloadConfig, RequestRejected, UnloadLoRAAdapter,
                               WorkerReady)
from services.transport import Endpoint, PeerLink, connect


class EngineDead(RuntimeError):
    """The engine core's link closed: every in-flight request ends with an error."""


class QueueFull(RuntimeError):
    """The engine core is at its queue limits: the client gets 503 and Retry-After."""


class EngineClient:
    """One WebSocket to the engine core shared by all of this process's requests.

    Each request gets a queue; the reader puts EngineCoreOutput deltas (for every
    sample) or a RequestRejected on it, and None when the engine goes away. Metrics
    requests are answered in order on the same link, so replies match a FIFO of
    waiters; LoRA, control and config requests carry an id their reply repeats (a load
    is answered only when the worker has checked the adapter, a sleep once it slept).
    Health is never asked for: the engine core pushes HealthSnapshots, and its running
    config (ConfigUpdate, to ``on_config``) on joining and after every applied reload.
    """

    def __init__(self, endpoint: Endpoint, client_id: str):
        self.endpoint = endpoint
        self.client_id = client_id
        self._link: PeerLink | None = None
        self._session = None
        self._queues: dict[str, asyncio.Queue] = {}
        # replies to GetMetrics come back in order on the one link
        self._waiters: dict[type, deque[asyncio.Future]] = {Metrics: deque()}
        self._reply_waiters: dict[str, asyncio.Future] = {}  # LoRA/control/config id → reply
        self._reply_ids = itertools.count()
        self.on_config = None  # called with each ConfigUpdate's JSON (live retune)
        self.on_cache_events = None  # called with each KVCacheEvents (data parallelism)
        # Data parallelism: awaited with the requests that had no answer yet when the
        # link closed; returns those it sent elsewhere (their queues stay open).
        self.on_lost = None
        self._answered: set[str] = set()  # requests with an output or a rejection
        self.config_json: str | None = None  # the latest one
        self._reader: asyncio.Task | None = None
        self.model_facts: ModelFacts | None = None  # from the engine core's WorkerReady
        self.alive = False
        self.dead = asyncio.Event()  # set once the link is gone for good
        # The engine core's last QueueState: while full, requests are refused before
        # they are tokenized. Only a hint: the engine core re-checks every add.
        self.queue_state = QueueState(is_full=False)
        self._health: HealthSnapshot | None = None  # the engine core's latest snapshot
        self._health_at = 0.0  # when it arrived (monotonic)

    num_replicas = 1  # EngineReplicas (engine_replicas.py) stands for several

    def replica_of(self, req_id: str) -> int | None:
        """Which data-parallel replica serves ``req_id``: None, there is only one."""
        return None

    async def start(self, timeout: float = 300.0) -> ModelFacts:
        """Connect (retrying until ``timeout``) and read the engine's model limits."""
        self._link, self._session = await connect(self.endpoint, "engine-core", timeout)
        messages = self._link.messages()
        first = await anext(messages, None)
        if not isinstance(first, WorkerReady):
            await self.close()
            raise ProtocolError(f"the engine core's first frame was {type(first).__name__}")
        self.model_facts = first.facts
        self.alive = True
        self._reader = asyncio.get_running_loop().create_task(self._read(messages))
        return first.facts

    async def _read(self, messages) -> None:
        async for message in messages:
            if isinstance(message, OutputDelta):
                for out in message.outputs:
                    key = out.parent_req_id or out.req_id
                    queue = self._queues.get(key)
                    if queue is not None:
                        queue.put_nowait(out)
                        self._answered.add(key)
            elif isinstance(message, QueueState):
                self.queue_state = message
            elif isinstance(message, HealthSnapshot):
                self._health, self._health_at = message, time.monotonic()
            elif isinstance(message, RequestRejected):
                queue = self._queues.get(message.req_id)
                if queue is not None:
                    queue.put_nowait(message)
                    self._answered.add(message.req_id)
            elif isinstance(message, ConfigUpdate):
                self.config_json = message.config_json
                if self.on_config is not None:
                    self.on_config(message.config_json)
            elif isinstance(message, KVCacheEvents):
                if self.on_cache_events is not None:
                    self.on_cache_events(message)
            elif isinstance(message, (LoRAReply, ControlReply, ConfigReloaded)):
                waiter = self._reply_waiters.pop(message.request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(message)
            elif isinstance(message, Metrics) and self._waiters[Metrics]:
                waiter = self._waiters[type(message)].popleft()
                if not waiter.done():
                    waiter.set_result(message)
        self.alive = False
        taken: set[str] = set()
        if self.on_lost is not None:
            taken = await self.on_lost([r for r in self._queues if r not in self._answered])
        self.dead.set()
        for req_id, queue in self._queues.items():
            if req_id not in taken:
                queue.put_nowait(None)
        for waiter in [*(w for ws in self._waiters.values() for w in ws),
                       *self._reply_waiters.values()]:
            if not waiter.done():
                waiter.set_exception(EngineDead("the engine core went away"))

    async def add(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  traceparent: str | None = None, cache_salt: str | None = None,
                  tenant: str | None = None, tenant_weight: float = 1.0,
                  lora_name: str | None = None, batch_id: str | None = None,
                  queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Send a request; ``cache_salt`` (the tenant's, from auth) keys its cache blocks,
        ``tenant`` and its weight are what the fair scheduler shares by, ``lora_name``
        the adapter the client named (the engine core resolves it), ``batch_id`` the
        request's id on each prompt of a multi-prompt request. ``queue``: answer
        on this one (a request moved here from a replica that went away)."""
        if not self.alive:
            raise EngineDead("the engine core is not reachable")
        queue = queue if queue is not None else asyncio.Queue()
        self._queues[req_id] = queue
        await self._link.send(AddRequest(req_id, prompt_token_ids, params, self.client_id,
                                         time.time(), cache_salt=cache_salt,
                                         traceparent=traceparent, tenant=tenant,
                                         tenant_weight=tenant_weight, lora_name=lora_name,
                                         batch_id=batch_id))
        return queue

    async def abort(self, req_ids: list[str]) -> None:
        if self.alive and req_ids:
            await self._link.send(AbortRequest(req_ids))

    async def _ask(self, question, reply_type: type, timeout: float):
        if not self.alive:
            raise EngineDead("the engine core is not reachable")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[reply_type].append(waiter)
        await self._link.send(question)
        return await asyncio.wait_for(waiter, timeout)

    def fresh_health(self, max_age_s: float = HEALTH_MAX_AGE_S) -> HealthSnapshot | None:
        """The engine core's latest health snapshot; None while the link is down or when
        none arrived within ``max_age_s`` (the engine core went quiet). No round trip."""
        if not self.alive or self._health is None:
            return None
        return self._health if time.monotonic() - self._health_at <= max_age_s else None

    async def metrics(self, timeout: float = 5.0) -> str:
        """The engine core's Prometheus text."""
        return (await self._ask(GetMetrics(), Metrics, timeout)).text

    async def lora(self, kind: str, lora_name: str = "", lora_path: str = "",
                   timeout: float = 120.0) -> LoRAReply:
        """One LoRA round trip: ``kind`` "load", "unload" or "list"."""
        make = {"load": lambda rid: LoadLoRAAdapter(rid, lora_name, lora_path),
                "unload": lambda rid: UnloadLoRAAdapter(rid, lora_name),
                "list": lambda rid: ListLoRAAdapters(rid)}[kind]
        return await self._round_trip("lora", make, timeout)

    async def control(self, op: str, timeout: float, **fields) -> ControlReply:
        """One control round trip (services/control_protocol.py): ``op`` and the
        ControlRequest ``fields`` it takes (level, abort_in_flight, path ...)."""
        return await self._round_trip(
            "control", lambda rid: ControlRequest(rid, op, **fields), timeout)

    async def reload_config(self, timeout: float = 90.0) -> ConfigReloaded:
        """Ask the engine core to re-read the YAML; its answer comes after this
        process has taken the new config (the ConfigUpdate precedes it on the link)."""
        return await self._round_trip("config", ReloadConfig, timeout)

    async def _round_trip(self, kind: str, make, timeout: float):
        """Send ``make(request_id)`` and wait for the reply repeating that id."""
        if not self.alive:
            raise EngineDead("the engine core is not reachable")
        request_id = f"{self.client_id}-{kind}-{next(self._reply_ids)}"
        waiter = asyncio.get_running_loop().create_future()
        self._reply_waiters[request_id] = waiter
        try:
            await self._link.send(make(request_id))
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._reply_waiters.pop(request_id, None)

    def forget(self, req_id: str) -> None:
        self._queues.pop(req_id, None)
        self._answered.discard(req_id)

    def queue_of(self, req_id: str) -> asyncio.Queue | None:
        return self._queues.get(req_id)

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
        if self._session is not None:
            await self._session.close()
