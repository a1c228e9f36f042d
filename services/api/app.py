"""The OpenAI-compatible HTTP API (aiohttp): the routes of one API process.

    connection (connection_handler.py: deadlines, framing; connection_guard.py: cap)
    ─▶ [Expect: 100-continue (expect_continue.py)]
    ─▶ auth (auth.py) ─▶ errors (errors.py) ─▶ admission (admission.py) ─▶ route
A completion or chat route reads its body within the process's body budget
(body_budget.py), validates it (request_validation.py) and, counted in flight from
then on, hands it to a :class:`Generation` (generation.py), which tokenizes (on the
process's tokenizer threads, tokenizer_pool.py), runs and answers it; the other routes
answer from the tokenizer or the engine core's gauges.
"""
from __future__ import annotations

import asyncio
import os

from aiohttp import web

from config.schema import APIConfig
from services.api.admission import Admission
from services.api.api_metrics import APIMetrics
from services.api.auth import CACHE_SALT, TENANT, APIKeys, Authenticator
from services.api.body_budget import BodyBudget
from services.api.connection_guard import CONNECTION_GUARD, ConnectionGuard
from services.api.engine_client import EngineClient, EngineDead
from services.api.errors import error_middleware
from services.api.expect_continue import ExpectContinue
from services.api.generation import Generation
from services.api.openai_protocol import APIError, unavailable
from services.api.openapi import openapi_document
from services.api.request_body import check_declared_size, parse_json_object, read_body
from services.api.request_validation import RequestValidator, ValidationLimits, check_model
from services.api.token_routes import TokenRoutes
from services.api.tokenizer_pool import TokenizerPool
from services.api.vllm_routes import VLLMRoutes
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
        self.validator = RequestValidator(ValidationLimits.from_config(
            self.api, max_model_len,
            facts.vocab_size if facts is not None else tokenizer.vocab_size,
            tokenizer.token_span))
        self.admission = Admission(engine)
        self.body_budget = BodyBudget(self.api.max_buffered_body_bytes)
        self.connections = ConnectionGuard(self.api)
        self.api_metrics = APIMetrics(self.connections, self.body_budget)
        self.tokens = TokenizerPool(tokenizer, self.api.num_tokenizer_threads,
                                    self.api.allow_special_tokens_in_content)

    def app(self) -> web.Application:
        public = {"/health", "/metrics"} if self.api.public_metrics else {"/health"}
        auth = Authenticator(self.api_keys, public)
        # auth first: a caller without a key learns nothing, not even that we are busy
        app = web.Application(middlewares=[auth.middleware, error_middleware,
                                           self.admission.middleware],
                              client_max_size=self.api.max_body_bytes)
        app.on_cleanup.append(self._close)
        app[CONNECTION_GUARD] = self.connections
        # Expect: 100-continue runs before the middlewares: the same checks, in order
        expect = ExpectContinue([
            auth.check, self.admission.check_request,
            lambda request: check_declared_size(request, self.api.max_body_bytes),
            self.body_budget.check_request]).handle
        for path, handler in (("/v1/completions", self.completions),
                              ("/v1/chat/completions", self.chat_completions)):
            app.router.add_post(path, handler, expect_handler=expect)
        for path, handler in (("/openapi.json", self.openapi), ("/v1/models", self.models),
                              ("/health", self.health), ("/version", self.version),
                              ("/metrics", self.metrics)):
            app.router.add_get(path, handler, expect_handler=expect)
        TokenRoutes(self.tokens, self.validator, self._body).add_to(app.router, expect)
        VLLMRoutes(self).add_to(app.router, expect)
        return app

    async def _close(self, app: web.Application) -> None:
        self.tokens.close()

    async def _body(self, request) -> dict:
        with self.body_budget.reservation() as reservation:
            raw = await read_body(request, self.api.max_body_bytes, reservation)
            body = parse_json_object(raw)
        check_model(body, self.model_name)
        return body

    def _generation(self, request: web.Request, checked, chat: bool) -> Generation:
        tenant = request.get(TENANT)
        return Generation.start(request, checked, chat, engine=self.engine,
                                tokenizer=self.tokenizer, validator=self.validator,
                                model_name=self.model_name, tracer=self.tracer,
                                cache_salt=request.get(CACHE_SALT), tenant=tenant,
                                tenant_weight=self.api.tenant_weights.get(tenant, 1.0))

    async def completions(self, request: web.Request,
                          body: dict | None = None) -> web.StreamResponse:
        checked = self.validator.completion(body if body is not None
                                            else await self._body(request))

        async def tokenize() -> list[list[int]]:  # text prompts passed the character bound
            return [await self.tokens.encode(p) if isinstance(p, str) else p
                    for p in checked.prompts]

        with self.admission.admitted():
            return await self._generation(request, checked, chat=False).respond(
                request, tokenize)

    async def chat_completions(self, request: web.Request,
                               body: dict | None = None) -> web.StreamResponse:
        checked = self.validator.chat(body if body is not None
                                      else await self._body(request))

        async def tokenize() -> list[list[int]]:
            return [await self.tokens.encode_chat(
                checked.messages, checked.add_generation_prompt,
                lambda text: self.validator.check_prompt_text(text, "messages"))]

        with self.admission.admitted():
            return await self._generation(request, checked, chat=True).respond(
                request, tokenize)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "folio",
                "max_model_len": self.max_model_len}

    async def models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.model_card()]})

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
        """Prometheus text: the engine core's metrics, the same from every API process,
        then this process's own (api_metrics.py)."""
        if not self.enable_metrics:
            raise APIError(404, "metrics are off (observability.enable_metrics)",
                           "not_found_error")
        try:
            text = await self.engine.metrics()
        except (EngineDead, asyncio.TimeoutError):
            raise unavailable("the engine core is unavailable")
        if text and not text.endswith("\n"):
            text += "\n"
        return web.Response(text=text + self.api_metrics.render(), content_type="text/plain",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def version(self, request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def openapi(self, request) -> web.Response:
        """The OpenAPI 3 description of these routes (what schemathesis fuzzes)."""
        return web.json_response(openapi_document(VERSION, self.model_name,
                                                  self.validator.limits, self.api_keys.enabled))
