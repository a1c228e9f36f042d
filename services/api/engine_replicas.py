"""The API process's links to ``parallel.data_parallel_size`` engine replicas, behind
the same interface as one EngineClient, so that the routes need not know how many
engine cores serve them.

    Generation.add ─▶ ReplicaRouter.route ─▶ EngineClient of replica r ─▶ engine core r
    control, LoRA, config reload ─▶ every live replica (the answer combines theirs)
    /health, /metrics ─▶ every replica: one aggregate, and each replica on its own

A replica whose link closed, whose health snapshot went stale or says it failed is
routed around and reported by /health; the process stops (``dead``) only when every
replica is gone. Each replica pushes its prefix cache's changes (KVCacheEvents), which
the router keeps per replica.
"""
from __future__ import annotations

import asyncio
import dataclasses

from engine_core.block_hash import make_hash_fn
from engine_core.model_facts import ModelFacts
from observability.logging import get_logger
from services.api.engine_client import EngineClient, EngineDead
from services.api.replica_metrics import merge_metrics
from services.api.replica_router import ReplicaRouter, Route
from services.protocol import ConfigReloaded, ControlReply, HealthSnapshot, LoRAReply, QueueState

log = get_logger(__name__)

# Health gauges that do not add up across replicas: how each one combines.
_MEAN_GAUGES = frozenset({"kv_cache_usage"})
_MAX_GAUGES = frozenset({"is_sleeping", "sleep_level", "seconds_since_last_step",
                         "max_num_seqs", "max_num_batched_tokens"})
_MIN_GAUGES = frozenset({"is_queue_full"})


class EngineReplicas:
    """One EngineClient per replica and the router that spreads requests over them."""

    def __init__(self, clients: list[EngineClient], policy: str, max_imbalance: int,
                 hash_algorithm: str, enable_caching: bool = True,
                 metrics_prefix: str = "folio"):
        self.clients = clients
        self.policy, self.max_imbalance = policy, max_imbalance
        self.hash_algorithm, self.enable_caching = hash_algorithm, enable_caching
        self.metrics_prefix = metrics_prefix
        self.router: ReplicaRouter | None = None  # made once the block size is known
        self._routes: dict[str, Route] = {}  # added req id → where it went
        self._adds: dict[str, tuple] = {}  # added req id → its add() arguments
        self._on_config = None
        self.model_facts: ModelFacts | None = None
        self.dead = asyncio.Event()  # every replica is gone
        self._watchers: list[asyncio.Task] = []

    @property
    def num_replicas(self) -> int:
        return len(self.clients)

    async def start(self, timeout: float = 300.0) -> ModelFacts:
        """Connect to every replica (all must answer at start-up)."""
        facts = await asyncio.gather(*(c.start(timeout) for c in self.clients))
        self.model_facts = facts[0]
        self.router = ReplicaRouter(len(self.clients), self.policy, self.max_imbalance,
                                    facts[0].block_size, make_hash_fn(self.hash_algorithm),
                                    self.enable_caching)
        loop = asyncio.get_running_loop()
        for i, client in enumerate(self.clients):
            client.on_cache_events = (lambda events, i=i:
                                      self.router.on_cache_events(i, events))
            client.on_lost = lambda req_ids, i=i: self._move(i, req_ids)
            self._watchers.append(loop.create_task(self._watch(i, client)))
        return facts[0]

    async def _watch(self, replica: int, client: EngineClient) -> None:
        await client.dead.wait()
        self.router.on_replica_lost(replica)
        log.error("engine replica went away; routing around it", replica=replica,
                  num_alive=len(self.alive_replicas()))
        if all(c.dead.is_set() for c in self.clients):
            self.dead.set()

    # ---- which replicas may take work

    def _is_serving(self, client: EngineClient) -> bool:
        health = client.fresh_health()
        return client.alive and health is not None and health.ok

    def alive_replicas(self) -> list[int]:
        """Replicas whose link is up and whose latest snapshot says they serve."""
        return [i for i, c in enumerate(self.clients) if self._is_serving(c)]

    def _routable(self) -> list[int]:
        alive = self.alive_replicas()
        not_full = [i for i in alive if not self.clients[i].queue_state.is_full]
        return not_full or alive

    @property
    def alive(self) -> bool:
        return any(c.alive for c in self.clients)

    @property
    def queue_state(self) -> QueueState:
        """Full only when every live replica is full (the router avoids full ones)."""
        states = [self.clients[i].queue_state for i in self.alive_replicas()]
        return QueueState(bool(states) and all(s.is_full for s in states),
                          sum(s.num_waiting for s in states),
                          sum(s.num_waiting_tokens for s in states))

    # ---- requests

    async def add(self, req_id: str, prompt_token_ids: list[int], params, traceparent=None,
                  cache_salt: str | None = None, lora_name: str | None = None,
                  **fields) -> asyncio.Queue:
        """Route and send a request; a replica that fails the send is skipped."""
        args = (prompt_token_ids, params, traceparent, cache_salt, lora_name, fields)
        queue = await self._send(req_id, args, tried=set())
        self._adds[req_id] = args
        return queue

    async def _send(self, req_id: str, args: tuple, tried: set[int],
                    queue: asyncio.Queue | None = None) -> asyncio.Queue:
        prompt_token_ids, params, traceparent, cache_salt, lora_name, fields = args
        while True:
            candidates = [i for i in self._routable() if i not in tried]
            if not candidates:
                raise EngineDead("no engine replica is reachable")
            route = self.router.route(prompt_token_ids, candidates, cache_salt, lora_name)
            try:
                queue = await self.clients[route.replica].add(
                    req_id, prompt_token_ids, params, traceparent, cache_salt=cache_salt,
                    lora_name=lora_name, queue=queue, **fields)
            except (EngineDead, ConnectionError, RuntimeError):
                self.router.finish(route)
                tried.add(route.replica)
                continue
            self._routes[req_id] = route
            return queue

    async def _move(self, replica: int, req_ids: list[str]) -> set[str]:
        """Replica ``replica``'s link closed: send its requests that had no answer yet
        (the client has seen nothing of them) to the other replicas; returns those
        moved. The others end with the engine-lost error."""
        moved = set()
        for req_id in req_ids:
            route, args = self._routes.get(req_id), self._adds.get(req_id)
            if route is None or args is None or route.replica != replica:
                continue
            self.router.finish(route)
            try:
                await self._send(req_id, args, {replica},
                                 self.clients[replica].queue_of(req_id))
            except EngineDead:
                del self._routes[req_id]
                continue
            moved.add(req_id)
        if moved:
            log.warning("requests moved off a lost replica", replica=replica,
                        num_moved=len(moved))
        return moved

    def replica_of(self, req_id: str) -> int | None:
        route = self._routes.get(req_id)
        return route.replica if route is not None else None

    def _route_of(self, engine_req_id: str) -> Route | None:
        """The route of an added id or of one of its samples ("<i>_<id>")."""
        route = self._routes.get(engine_req_id)
        if route is None and "_" in engine_req_id:
            route = self._routes.get(engine_req_id.split("_", 1)[1])
        return route

    async def abort(self, req_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for req_id in req_ids:
            route = self._route_of(req_id)
            targets = [route.replica] if route is not None else range(len(self.clients))
            for r in targets:
                by_replica.setdefault(r, []).append(req_id)
        for r, ids in by_replica.items():
            await self.clients[r].abort(ids)

    def forget(self, req_id: str) -> None:
        self._adds.pop(req_id, None)
        route = self._routes.pop(req_id, None)
        if route is not None:
            self.clients[route.replica].forget(req_id)
            self.router.finish(route)

    # ---- health and metrics

    def fresh_health(self) -> HealthSnapshot | None:
        """One snapshot for the whole set: ok while any replica serves; gauges summed
        (usage averaged, flags and limits the largest) over the serving replicas."""
        snapshots = [s for c in self.clients if (s := c.fresh_health()) is not None and s.ok]
        if not snapshots:
            return None if not any(c.fresh_health() for c in self.clients) else \
                HealthSnapshot(False, {})
        detail: dict[str, float] = {}
        for key in snapshots[0].detail:
            values = [s.detail.get(key, 0.0) for s in snapshots]
            detail[key] = (sum(values) / len(values) if key in _MEAN_GAUGES
                           else max(values) if key in _MAX_GAUGES
                           else min(values) if key in _MIN_GAUGES else sum(values))
        detail["num_replicas"] = len(self.clients)
        detail["num_replicas_serving"] = len(snapshots)
        return HealthSnapshot(True, detail)

    def replica_report(self) -> list[dict]:
        """Each replica for /health: status ("ok", "failed", "unavailable" while its
        snapshot is stale, "dead" once its link closed), its gauges, and this process's
        requests in flight there."""
        report = []
        for i, client in enumerate(self.clients):
            snapshot = client.fresh_health()
            status = ("dead" if client.dead.is_set() else "unavailable" if snapshot is None
                      else "ok" if snapshot.ok else "failed")
            report.append({"replica": i, "status": status,
                           "num_in_flight": self.router.loads()[i],
                           "engine": snapshot.detail if snapshot is not None else {}})
        return report

    async def metrics(self, timeout: float = 5.0) -> str:
        """Every replica's metrics under a ``replica`` label, their sums under
        ``replica="all"``, and ``<prefix>:replica_up`` per replica."""
        async def one(client: EngineClient) -> str | None:
            try:
                return await client.metrics(timeout)
            except (EngineDead, asyncio.TimeoutError, ConnectionError, RuntimeError):
                return None
        texts = await asyncio.gather(*(one(c) for c in self.clients))
        if all(t is None for t in texts):
            raise EngineDead("no engine replica is reachable")
        return merge_metrics(list(texts), self.metrics_prefix)

    # ---- control routes: every live replica

    async def _each(self, call) -> list:
        live = [c for c in self.clients if c.alive]
        if not live:
            raise EngineDead("no engine replica is reachable")
        return await asyncio.gather(*(call(c) for c in live))

    async def lora(self, kind: str, lora_name: str = "", lora_path: str = "",
                   timeout: float = 120.0) -> LoRAReply:
        """"list": one replica's answer (each holds the same adapters); "load" and
        "unload": every replica, the first failure if any failed."""
        if kind == "list":
            serving = self._routable()
            if not serving:
                raise EngineDead("no engine replica is reachable")
            return await self.clients[serving[0]].lora(kind, timeout=timeout)
        replies = await self._each(lambda c: c.lora(kind, lora_name, lora_path, timeout))
        return next((r for r in replies if not r.ok), replies[0])

    async def control(self, op: str, timeout: float, **fields) -> ControlReply:
        """Every live replica; the first failure if any failed. collective_rpc's
        ``result`` is the list of the replicas' results, in replica order."""
        replies = await self._each(lambda c: c.control(op, timeout, **fields))
        failed = next((r for r in replies if not r.ok), None)
        if failed is not None:
            return failed
        if op == "collective_rpc":
            return dataclasses.replace(replies[0], result=[r.result for r in replies])
        return dataclasses.replace(replies[0],
                                   is_sleeping=all(r.is_sleeping for r in replies))

    async def reload_config(self, timeout: float = 90.0) -> ConfigReloaded:
        """Each replica's engine core re-reads the YAML; a refusal or an invalid file
        wins, else "applied" if any applied (the changed keys of all)."""
        replies = await self._each(lambda c: c.reload_config(timeout))
        bad = next((r for r in replies if r.result in ("refused", "invalid")), None)
        if bad is not None:
            return bad
        changed = sorted({k for r in replies for k in r.changed})
        result = "applied" if any(r.result == "applied" for r in replies) else "unchanged"
        return dataclasses.replace(replies[0], result=result, changed=changed)

    @property
    def on_config(self):
        return self._on_config

    @on_config.setter
    def on_config(self, callback) -> None:
        self._on_config = callback
        for client in self.clients:
            client.on_config = callback

    @property
    def config_json(self) -> str | None:
        return next((c.config_json for c in self.clients if c.config_json is not None), None)

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients))
