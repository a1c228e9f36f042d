"""The OpenAI-compatible HTTP API (aiohttp): the routes of one API process.

    request ─▶ auth (auth.py) ─▶ errors (errors.py) ─▶ admission (admission.py) ─▶ route
A completion or chat route validates its body (request_validation.py) and hands it to
a :class:`Generation` (generation.py), which tokenizes, runs and answers it; the other
routes answer from the tokenizer or the engine core's gauges.
"""
from __future__ import annotations

import asyncio
import os

from aiohttp import web

from config.schema import APIConfig
from services.api.admission import Admission
from services.api.auth import CACHE_SALT, APIKeys, auth_middleware
from services.api.engine_client import EngineClient, EngineDead
from services.api.errors import error_middleware
from services.api.generation import Generation
from services.api.openai_protocol import APIError, bad, unavailable
from services.api.openapi import openapi_document
from services.api.request_body import parse_json_object, read_body
from services.api.request_validation import RequestValidator, ValidationLimits, check_model
from services.api.token_routes import TokenRoutes
from text.chat_template import ChatTemplateError
from text.tokenizer import Tokenizer

VERSION = "0.1.0"


class APIServer:
    """Routes of one API process, sharing one EngineClient and one Tokenizer."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, tracer=None, enable_metrics: bool = True,
                 api: APIConfig | None = None, api_keys: APIKeys | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.tracer = tracer  # an OpenTelemetry tracer, or None when tracing is off
        self.enable_metrics = enable_metrics
        self.model_name, self.max_model_len = model_name, max_model_len
        self.api = api or APIConfig()
        self.api_keys = api_keys if api_keys is not None else APIKeys.from_sources(
            self.api.api_keys, os.environ)
        facts = engine.model_facts  # the model's own vocabulary bounds prompt token ids
        self.validator = RequestValidator(ValidationLimits(
            max_model_len, facts.vocab_size if facts is not None else tokenizer.vocab_size,
            self.api.max_n, self.api.max_stop_strings, self.api.max_logprobs))
        self.admission = Admission(engine)

    def app(self) -> web.Application:
        public = {"/health", "/metrics"} if self.api.public_metrics else {"/health"}
        # auth first: a caller without a key learns nothing, not even that we are busy
        app = web.Application(middlewares=[auth_middleware(self.api_keys, public),
                                           error_middleware, self.admission.middleware],
                              client_max_size=self.api.max_body_bytes)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        TokenRoutes(self.tokenizer, self._body, self.max_model_len).add_to(app.router)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def _body(self, request) -> dict:
        body = parse_json_object(await read_body(request, self.api.max_body_bytes))
        check_model(body, self.model_name)
        return body

    def _generation(self, request: web.Request, checked, chat: bool) -> Generation:
        return Generation.start(request, checked, chat, engine=self.engine,
                                tokenizer=self.tokenizer, validator=self.validator,
                                model_name=self.model_name, tracer=self.tracer,
                                cache_salt=request.get(CACHE_SALT))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        checked = self.validator.completion(await self._body(request))
        prompt = checked.prompt

        def tokenize() -> list[int]:
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

        return await self._generation(request, checked, chat=False).respond(request, tokenize)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        checked = self.validator.chat(await self._body(request))

        def tokenize() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    checked.messages, add_generation_prompt=checked.add_generation_prompt)
            except ChatTemplateError as e:
                raise bad(str(e), "messages") from None
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await self._generation(request, checked, chat=True).respond(request, tokenize)

    async def models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "folio",
            "max_model_len": self.max_model_len}]})

    async def health(self, request) -> web.Response:
        """200 from the engine core's latest pushed snapshot (a probe never reaches the
        engine core); 503 while this process drains, when the link is down, the
        snapshot is stale or says the engine failed. The gauges go to callers with a
        valid key, or to all when the API is open or ``api.public_health_detail``."""
        if self.admission.draining:
            raise unavailable("the server is shutting down", "shutting_down")
        snapshot = self.engine.fresh_health()
        if snapshot is None:
            raise unavailable("the engine core is unavailable")
        if not snapshot.ok:
            raise unavailable("the engine core has failed")
        # /health is public: the auth middleware lets a caller without a key through,
        # and sets the tenant's cache salt only for a valid key.
        if self.api_keys.enabled and not (self.api.public_health_detail
                                          or CACHE_SALT in request):
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "ok", "engine": snapshot.detail,
                                  "api": {"num_in_flight": self.admission.num_in_flight}})

    async def metrics(self, request) -> web.Response:
        """Prometheus text: the engine core's metrics, the same from every API process."""
        if not self.enable_metrics:
            raise APIError(404, "metrics are off (observability.enable_metrics)",
                           "not_found_error")
        try:
            text = await self.engine.metrics()
        except (EngineDead, asyncio.TimeoutError):
            raise unavailable("the engine core is unavailable")
        return web.Response(text=text, content_type="text/plain",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def version(self, request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def openapi(self, request) -> web.Response:
        """The OpenAPI 3 description of these routes (what schemathesis fuzzes)."""
        return web.json_response(openapi_document(VERSION, self.model_name,
                                                  self.validator.limits, self.api_keys.enabled))
