"""An in-process API server on a fake engine core, for fast tests of the HTTP edge.

The API process is the real one (APIServer, its middlewares and serve_api's limits);
only the engine link is replaced by :class:`FakeEngine`, which records what reached
it and answers every sample with ``max_tokens`` copies of token 42.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from config.lora import LoRAConfig
from config.schema import APIConfig
from engine_core.model_facts import ModelFacts
from engine_core.outputs import EngineCoreOutput, FinishReason
from services.api.app import APIServer
from services.api.auth import APIKeys
from services.api.http_server import serve_api
from services.protocol import HealthSnapshot, QueueState
from services.transport import Endpoint


@dataclass
class FakeEngine:
    """Stands in for EngineClient; ``added`` holds (req_id, ids, params, cache_salt)."""

    model_facts: ModelFacts = field(default_factory=lambda: ModelFacts(
        num_blocks=64, block_size=16, max_model_len=128, vocab_size=49152,
        eos_token_ids=[2], dtype="float32", device="cpu"))
    added: list = field(default_factory=list)
    alive: bool = True
    fail_with: Exception | None = None  # raised by add(): a bug behind the API
    # replaces the default answer: (req_id, params) → the outputs to deliver, in order
    script: object | None = None
    aborted: list = field(default_factory=list)
    tenants: list = field(default_factory=list)  # (tenant, weight) of each add
    lora_names: list = field(default_factory=list)  # the LoRA adapter of each add
    batch_ids: list = field(default_factory=list)  # (req_id, batch_id) of each add
    queue_state: QueueState = field(default_factory=lambda: QueueState(is_full=False))
    # what fresh_health() returns: None plays a dead link or a stale snapshot
    health: HealthSnapshot | None = field(default_factory=lambda: HealthSnapshot(
        ok=True, detail={"num_running": 0.0}))

    def __post_init__(self):
        self.dead = asyncio.Event()

    async def add(self, req_id, ids, params, traceparent=None, cache_salt=None,
                  tenant=None, tenant_weight=1.0, lora_name=None, batch_id=None):
        if self.fail_with is not None:
            raise self.fail_with
        self.added.append((req_id, list(ids), params, cache_salt))
        self.tenants.append((tenant, tenant_weight))
        self.lora_names.append(lora_name)
        self.batch_ids.append((req_id, batch_id))
        queue: asyncio.Queue = asyncio.Queue()
        if self.script is not None:
            for out in self.script(req_id, params):
                queue.put_nowait(out)
            return queue
        num = params.max_tokens or 1
        for i in range(params.n):
            queue.put_nowait(EngineCoreOutput(
                req_id if params.n == 1 else f"{i}_{req_id}", [42] * num,
                finish_reason=FinishReason.LENGTH, parent_req_id=None if params.n == 1
                else req_id, index=i))
        return queue

    async def abort(self, req_ids):
        self.aborted.extend(req_ids)

    def forget(self, req_id):
        pass

    num_replicas = 1  # one engine core, as EngineClient

    def replica_of(self, req_id):
        return None

    def fresh_health(self):
        return self.health

    async def metrics(self, timeout=5.0):
        return "# no metrics\n"


@contextlib.asynccontextmanager
async def api_server(tokenizer, api: APIConfig | None = None, keys: tuple[str, ...] = (),
                     max_model_len: int = 128, tracer=None, enable_metrics: bool = True,
                     engine: FakeEngine | None = None, lora: LoRAConfig | None = None):
    """Yield (base URL, FakeEngine) of an API served on 127.0.0.1 with ``api``'s limits
    (and ``lora``'s adapter settings)."""
    api = api or APIConfig()
    engine = engine or FakeEngine()
    server = APIServer(engine, tokenizer, "folio-tiny", max_model_len, tracer=tracer,
                       enable_metrics=enable_metrics, api=api, api_keys=APIKeys(keys),
                       lora=lora)
    runner = await serve_api(server.app(), api, [Endpoint(host="127.0.0.1", port=0)])
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        await runner.cleanup()


async def raw_exchange(url: str, data: bytes, read_timeout: float = 5.0) -> tuple[int, bytes]:
    """Send raw bytes to the server; (status, body) of the first response."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout)
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), read_timeout)
        return status, body
    finally:
        writer.close()
