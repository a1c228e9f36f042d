"""vLLM's extra routes, for clients and platforms written against vLLM.

    GET  /ping              SageMaker's liveness probe: /health's answer
    POST /invocations       SageMaker's one entry: a chat body (``messages``) or a
                            completion body (``prompt``), served by that route
    GET  /load              ``{"server_load": requests in flight in this process}``
    GET  /tokenizer_info    the served tokenizer's size, special ids and chat template
    GET  /v1/models/{id}    the served model, or 404 naming ``model``
"""
from __future__ import annotations

from aiohttp import web

from services.api.openai_protocol import APIError, bad


class VLLMRoutes:
    """Routes that answer from the API server's own parts (``server``: an APIServer)."""

    def __init__(self, server):
        self.server = server

    def add_to(self, router: web.UrlDispatcher, expect_handler=None) -> None:
        for path, handler in (("/ping", self.ping), ("/load", self.load),
                              ("/tokenizer_info", self.tokenizer_info),
                              ("/v1/models/{model_id}", self.model)):
            router.add_get(path, handler, expect_handler=expect_handler)
        router.add_post("/ping", self.ping, expect_handler=expect_handler)
        router.add_post("/invocations", self.invocations, expect_handler=expect_handler)

    async def ping(self, request: web.Request) -> web.Response:
        return await self.server.health(request)

    async def load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.server.admission.num_in_flight})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        tokenizer = self.server.tokenizer
        return web.json_response({
            "tokenizer_class": type(tokenizer).__name__,
            "vocab_size": tokenizer.vocab_size,
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "eos_token_ids": list(tokenizer.eos_token_ids),
            "all_special_ids": list(tokenizer.all_special_ids),
            "model_max_length": self.server.max_model_len,
            "chat_template": tokenizer.chat_template})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.server.model_name:
            raise APIError(404, f"model {model_id[:100]!r} does not exist",
                           "not_found_error", "model", "model_not_found")
        return web.json_response(self.server.model_card())

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """Dispatch on the body's shape; the body is read once, by the chosen route."""
        body = await self.server._body(request)
        if "messages" in body:
            return await self.server.chat_completions(request, body)
        if "prompt" in body:
            return await self.server.completions(request, body)
        raise bad("an invocation holds 'messages' (chat) or 'prompt' (completion)",
                  "messages")
