"""The OpenAI-compatible HTTP API (aiohttp): the routes of one API process.

    connection (connection_handler.py: deadlines, framing; connection_guard.py: cap)
    ─▶ [Expect: 100-continue (expect_continue.py)]
    ─▶ auth (auth.py) ─▶ invalid-body charge ─▶ errors (errors.py)
    ─▶ admission (admission.py) ─▶ route
A completion or chat route reads its body within the process's body budget
(body_budget.py) and its tenant's body rate (body_rate.py; a body answered 400 once
read costs more of it), validates it (request_validation.py) and, counted in flight from
then on, hands it to a :class:`Generation` (generation.py), which tokenizes (on the
process's tokenizer threads, tokenizer_pool.py), runs and answers it; the other routes
answer from the tokenizer or the engine core's gauges.
"""
from __future__ import annotations

import asyncio
import os

from aiohttp import web

from config.lora import LoRAConfig
from config.schema import APIConfig
from services.api.admission import Admission
from services.api.api_metrics import APIMetrics
from services.api.auth import CACHE_SALT, TENANT, APIKeys, Authenticator
from services.api.body_budget import BodyBudget
from services.api.body_rate import BodyRate
from services.api.connection_guard import CONNECTION_GUARD, ConnectionGuard
from services.api.control_routes import ControlRoutes
from services.api.engine_client import EngineClient, EngineDead
from services.api.errors import error_middleware
from services.api.expect_continue import ExpectContinue
from services.api.generation import Generation
from services.api.grammar_check import GrammarChecker
from services.api.lora_routes import LoRARoutes
from services.api.openai_protocol import APIError, unavailable
from services.api.openapi import openapi_document
from services.api.public_pacing import PublicPacing
from services.api.request_body import check_declared_size, parse_json_object, read_body
from services.api.request_validation import RequestValidator, ValidationLimits, check_model
from services.api.token_routes import TokenRoutes
from services.api.tokenizer_pool import TokenizerPool
from services.api.vllm_routes import VLLMRoutes
from text.tokenizer import Tokenizer

BODY_BYTES = web.RequestKey("folio.body_bytes", int)  # the request body's size, once read

VERSION = "0.1.0"


class APIServer:
    """Routes of one API process, sharing one EngineClient and one Tokenizer."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, tracer=None, enable_metrics: bool = True,
                 api: APIConfig | None = None, api_keys: APIKeys | None = None,
                 lora: LoRAConfig | None = None, admin=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.tracer = tracer  # an OpenTelemetry tracer, or None when tracing is off
        self.enable_metrics = enable_metrics
        self.model_name, self.max_model_len = model_name, max_model_len
        self.api = api or APIConfig()
        self.admin = admin  # AdminRoutes (live retune), when the process has a config
        self.lora = lora or LoRAConfig()
        self.api_keys = api_keys if api_keys is not None else APIKeys.from_sources(
            self.api.api_keys, os.environ)
        facts = engine.model_facts  # the model's own vocabulary bounds prompt token ids
        self.validator = RequestValidator(ValidationLimits.from_config(
            self.api, max_model_len,
            facts.vocab_size if facts is not None else tokenizer.vocab_size,
            tokenizer.token_span))
        self.admission = Admission(engine)
        self.body_budget = BodyBudget(self.api.max_buffered_body_bytes)
        self.body_rate = BodyRate(self.api.tenant_body_bytes_per_s,
                                  self.api.tenant_body_burst_bytes,
                                  self.api.body_hold_s)
        self.connections = ConnectionGuard(self.api)
        self.public_pacing = PublicPacing(self.api.public_poll_interval_s)
        self.api_metrics = APIMetrics(self.connections, self.body_budget, self.body_rate,
                                      self.public_pacing)
        self.tokens = TokenizerPool(tokenizer, self.api.num_tokenizer_threads,
                                    self.api.allow_special_tokens_in_content)
        self.grammars = GrammarChecker(
            tokenizer, self.validator.limits.vocab_size,
            facts.eos_token_ids if facts is not None else tokenizer.eos_token_ids,
            self.api.grammar_compile_timeout_s)

    def app(self) -> web.Application:
        self.auth = auth = Authenticator(self.api_keys, self.public_paths())
        # auth first: a caller without a key learns nothing, not even that we are busy
        app = web.Application(middlewares=[auth.middleware, self._charge_invalid_bodies,
                                           error_middleware, self.admission.middleware],
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
        if self.lora.enable_lora and self.lora.allow_runtime_updates:
            LoRARoutes(self.engine, self.lora, self.model_name, self._body).add_to(
                app.router, expect)
        VLLMRoutes(self).add_to(app.router, expect)
        ControlRoutes(self.engine, self._body).add_to(app.router, expect)
        if self.admin is not None:
            self.admin.add_to(app.router, expect)
        return app

    def public_paths(self) -> set[str]:
        """Paths served without a key (api.public_metrics may change live)."""
        return {"/health", "/metrics"} if self.api.public_metrics else {"/health"}

    async def _close(self, app: web.Application) -> None:
        self.tokens.close()
        self.grammars.close()

    @web.middleware
    async def _charge_invalid_bodies(self, request: web.Request, handler):
        """A request whose body was read and then answered 400 costs its tenant more
        of its body rate (BodyRate.charge_invalid)."""
        response = await handler(request)
        if response.status == 400 and (num_bytes := request.get(BODY_BYTES)):
            self.body_rate.charge_invalid(request.get(TENANT), num_bytes)
        return response

    async def _body(self, request) -> dict:
        tenant = request.get(TENANT)
        declared = request.content_length or 0
        if declared > self.api.max_body_bytes:  # 413, not 429, once the rate covers it
            await self.body_rate.charge_refused(tenant, declared)
        check_declared_size(request, self.api.max_body_bytes)
        await self.body_rate.admit(tenant, declared)
        with self.body_budget.reservation() as reservation:
            raw = await read_body(request, self.api.max_body_bytes, reservation)
            request[BODY_BYTES] = len(raw)
            if request.content_length is None:  # chunked: charged once its size is known
                self.body_rate.take(tenant, len(raw), may_borrow=True)
            body = parse_json_object(raw, self.api.max_json_values)
        check_model(body, self.model_name, self.lora.enable_lora)
        return body

    def _generation(self, request: web.Request, checked, chat: bool,
                    lora_name: str | None) -> Generation:
        tenant = request.get(TENANT)
        return Generation.start(request, checked, chat, engine=self.engine,
                                tokenizer=self.tokenizer, validator=self.validator,
                                model_name=lora_name or self.model_name, tracer=self.tracer,
                                grammars=self.grammars,
                                cache_salt=request.get(CACHE_SALT), tenant=tenant,
                                tenant_weight=self.api.tenant_weights.get(tenant, 1.0),
                                lora_name=lora_name)

    async def _generation_body(self, request: web.Request, body: dict | None = None
                               ) -> tuple[dict, str | None]:
        """The checked body (read unless given) and the LoRA adapter its ``model`` names
        (None: the base)."""
        if body is None:
            body = await self._body(request)
        return body, check_model(body, self.model_name, self.lora.enable_lora)

    async def completions(self, request: web.Request,
                          body: dict | None = None) -> web.StreamResponse:
        """``body``: already read (``/invocations``); else read here."""
        body, lora_name = await self._generation_body(request, body)
        checked = self.validator.completion(body)

        async def tokenize() -> list[list[int]]:  # text prompts passed the character bound
            return [await self.tokens.encode(p) if isinstance(p, str) else p
                    for p in checked.prompts]

        with self.admission.admitted():
            return await self._generation(request, checked, False, lora_name).respond(
                request, tokenize)

    async def chat_completions(self, request: web.Request,
                               body: dict | None = None) -> web.StreamResponse:
        body, lora_name = await self._generation_body(request, body)
        checked = self.validator.chat(body)

        async def tokenize() -> list[list[int]]:
            return [await self.tokens.encode_chat(
                checked.messages, checked.add_generation_prompt,
                lambda text: self.validator.check_prompt_text(text, "messages"),
                checked.tools, checked.continue_final_message)]

        with self.admission.admitted():
            return await self._generation(request, checked, True, lora_name).respond(
                request, tokenize)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "folio",
                "max_model_len": self.max_model_len}

    async def models(self, request) -> web.Response:
        """The served model (``root`` itself, no ``parent``), then each LoRA adapter with
        the model as ``parent`` (asked of the engine core, the one registry of adapters)."""
        names = []
        if self.lora.enable_lora:
            try:
                names = [a.name for a in (await self.engine.lora("list", timeout=5.0)).adapters]
            except (EngineDead, asyncio.TimeoutError):
                raise unavailable("the engine core is unavailable")
        card = self.model_card()
        return web.json_response({"object": "list", "data": [
            {**card, "root": self.model_name, "parent": None},
            *({**card, "id": n, "root": n, "parent": self.model_name} for n in names)]})

    async def health(self, request) -> web.Response:
        """200 from the engine core's latest pushed snapshot (a probe never reaches the
        engine core), ``status`` "sleeping" while the model sleeps; 503 while this process drains, when the link is down, the
        snapshot is stale or says the engine failed. The gauges go to callers with a
        valid key, or to all when the API is open or ``api.public_health_detail``."""
        await self.public_pacing.pace(request)
        if self.admission.draining:
            raise unavailable("the server is shutting down", "shutting_down")
        snapshot = self.engine.fresh_health()
        if snapshot is None:
            raise unavailable("the engine core is unavailable")
        if not snapshot.ok:
            raise unavailable("the engine core has failed")
        # /health is public: the auth middleware lets a caller without a key through,
        # and sets the tenant's cache salt only for a valid key.
        status = "sleeping" if snapshot.detail.get("is_sleeping") else "ok"
        if self.api_keys.enabled and not (self.api.public_health_detail
                                          or CACHE_SALT in request):
            return web.json_response({"status": status})
        body = {"status": status, "engine": snapshot.detail,
                "api": {"num_in_flight": self.admission.num_in_flight}}
        if self.engine.num_replicas > 1:  # data parallelism: each replica on its own too
            body["replicas"] = self.engine.replica_report()
        return web.json_response(body)

    async def metrics(self, request) -> web.Response:
        """Prometheus text: the engine core's metrics, the same from every API process,
        then this process's own (api_metrics.py)."""
        await self.public_pacing.pace(request)
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
