"""vLLM's live LoRA routes: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

They exist only with ``lora.allow_runtime_updates`` and sit behind the API key like
every route. A load's ``lora_path`` must resolve, after ``..`` and symlinks, inside
one of ``lora.allowed_paths`` (400 otherwise, naming neither the path nor the
folders); the resolved path is what the worker reads, so a link swapped afterwards
cannot redirect it, and the worker refuses files inside that link out of the folder.
The engine core answers once the worker has read and checked the adapter; a bad
adapter is a 400 naming the problem, an unknown name to unload a 404. Unloading lets
the requests already using the adapter finish.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

from aiohttp import web

from config.lora import LoRAConfig
from services.api.engine_client import EngineClient
from services.api.fields import typed
from services.api.openai_protocol import APIError, bad, unavailable
from services.api.request_validation import MAX_MODEL_NAME_CHARS

MAX_PATH_CHARS = 4096


def confined_path(path: str, allowed_paths: tuple[str, ...]) -> str:
    """``path`` resolved (``..`` and symlinks followed), if inside an allowed folder."""
    if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise bad("'lora_path' must be a non-empty path", "lora_path")
    resolved = os.path.realpath(path)
    for root in allowed_paths:
        real_root = os.path.realpath(root)
        if os.path.commonpath([resolved, real_root]) == real_root:
            return resolved
    raise bad("'lora_path' is not inside lora.allowed_paths (after resolving '..' and "
              "symlinks)", "lora_path")


class LoRARoutes:
    """The two routes; ``read_body`` is the API's checked body reader."""

    def __init__(self, engine: EngineClient, config: LoRAConfig, served_name: str,
                 read_body: Callable[[web.Request], Awaitable[dict]]):
        self.engine, self.config, self.served_name = engine, config, served_name
        self.read_body = read_body

    def add_to(self, router: web.UrlDispatcher, expect_handler=None) -> None:
        router.add_post("/v1/load_lora_adapter", self.load, expect_handler=expect_handler)
        router.add_post("/v1/unload_lora_adapter", self.unload,
                        expect_handler=expect_handler)

    def _name(self, body: dict) -> str:
        name = typed(body, "lora_name", (str,)) if "lora_name" in body else None
        if not name or len(name) > MAX_MODEL_NAME_CHARS:
            raise bad(f"'lora_name' must be 1-{MAX_MODEL_NAME_CHARS} characters", "lora_name")
        if name == self.served_name:
            raise bad("'lora_name' is the base model's name", "lora_name")
        return name

    async def load(self, request: web.Request) -> web.Response:
        """``{"lora_name", "lora_path"}`` → 200 once the adapter is served."""
        body = await self.read_body(request)
        name = self._name(body)
        path = typed(body, "lora_path", (str,)) if "lora_path" in body else ""
        path = confined_path(path, self.config.allowed_paths)
        try:
            reply = await self.engine.lora("load", name, path)
        except asyncio.TimeoutError:
            raise unavailable("the adapter did not load in time") from None
        if not reply.ok:
            raise bad(reply.message, "lora_path" if reply.code == "bad_adapter" else None)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        """``{"lora_name"}`` → 200; requests using it finish, new ones get 404."""
        name = self._name(await self.read_body(request))
        reply = await self.engine.lora("unload", name)
        if not reply.ok:
            raise APIError(404, reply.message, "not_found_error", "lora_name",
                           "model_not_found")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
