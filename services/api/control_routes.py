"""The RL and eval hooks over HTTP (vLLM's routes), behind the API key like every route.

    POST /sleep?level=1|2[&abort=true]   free the KV pool (2: the weights too); answered
                                         once the worker slept (in-flight requests finish
                                         first, or are aborted with abort=true)
    POST /wake_up                        take them back
    GET  /is_sleeping                    {"is_sleeping": bool}
    POST /update_weights {"path": ...}   a safetensors file or folder the worker reads;
                                         400 naming the bad tensor, nothing changed
    POST /reset_prefix_cache             forget every cached prefix
    POST /collective_rpc {"method", "args"}  a method of worker.extension_cls;
                                         {"results": [one per worker]}

Sleep needs ``worker.enable_sleep_mode``, updates ``worker.enable_weight_updates``,
RPC a declared ``worker.extension_cls``: without them the routes answer 404 naming the
key. The engine core runs each verb between steps (engine_core_service/engine_control.py).
While asleep, generation requests get 503 ``sleeping`` and /health says so.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from services.api.engine_client import EngineClient
from services.api.fields import typed
from services.api.openai_protocol import APIError, bad, unavailable
from services.api.lora_routes import MAX_PATH_CHARS

CONTROL_TIMEOUT_S = 600.0  # a sleep waits for in-flight requests; a wake may reload weights
MAX_RPC_ARGS = 64


class ControlRoutes:
    """The routes above; ``read_body`` is the API's checked body reader."""

    def __init__(self, engine: EngineClient, read_body: Callable[[web.Request], Awaitable[dict]]):
        self.engine, self.read_body = engine, read_body

    def add_to(self, router: web.UrlDispatcher, expect_handler=None) -> None:
        for path, handler in (("/sleep", self.sleep), ("/wake_up", self.wake_up),
                              ("/update_weights", self.update_weights),
                              ("/reset_prefix_cache", self.reset_prefix_cache),
                              ("/collective_rpc", self.collective_rpc)):
            router.add_post(path, handler, expect_handler=expect_handler)
        router.add_get("/is_sleeping", self.is_sleeping, expect_handler=expect_handler)

    async def _ask(self, op: str, **fields):
        try:
            reply = await self.engine.control(op, CONTROL_TIMEOUT_S, **fields)
        except asyncio.TimeoutError:
            raise unavailable(f"{op} did not finish in time") from None
        if reply.ok:
            return reply
        if reply.code == "not_enabled":
            raise APIError(404, reply.message, "not_found_error", code="not_enabled")
        if reply.code == "bad_request":
            raise bad(reply.message, reply.param)
        raise APIError(500, reply.message, "server_error", code="control_failed")

    async def sleep(self, request: web.Request) -> web.Response:
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            raise bad("'level' must be 1 or 2", "level")
        abort = request.query.get("abort", "false").lower()
        if abort not in ("true", "false", "1", "0"):
            raise bad("'abort' must be true or false", "abort")
        reply = await self._ask("sleep", level=int(level), abort_in_flight=abort in ("true", "1"))
        return web.json_response({"is_sleeping": reply.is_sleeping})

    async def wake_up(self, request: web.Request) -> web.Response:
        reply = await self._ask("wake_up")
        return web.json_response({"is_sleeping": reply.is_sleeping})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        reply = await self._ask("is_sleeping")
        return web.json_response({"is_sleeping": reply.is_sleeping})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await self.read_body(request)
        path = typed(body, "path", (str,)) if "path" in body else ""
        if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
            raise bad("'path' must name a safetensors file or folder", "path")
        reply = await self._ask("update_weights", path=path)
        return web.json_response({"status": "ok", "message": reply.message})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        await self._ask("reset_prefix_cache")
        return web.json_response({"status": "ok"})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await self.read_body(request)
        method = typed(body, "method", (str,)) if "method" in body else ""
        if not method:
            raise bad("'method' must name a method of the worker extension", "method")
        args = typed(body, "args", (list,)) if "args" in body else []
        if len(args) > MAX_RPC_ARGS:
            raise bad(f"'args' holds at most {MAX_RPC_ARGS} values", "args")
        reply = await self._ask("collective_rpc", method=method, args=args)
        # several replicas (engine_replicas.py) answer with one result each
        results = reply.result if self.engine.num_replicas > 1 else [reply.result]
        return web.json_response({"results": results})
