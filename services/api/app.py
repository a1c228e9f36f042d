"""The OpenAI-compatible HTTP API (aiohttp): completions, chat, models, tokenize, health.

Each request is validated and tokenized here, sent to the engine core, and its deltas
are detokenized incrementally (stop strings trimmed across deltas) into JSON or SSE.
A client that disconnects aborts its request so its KV blocks are freed. While the
engine core reports its queue full, new generation requests get 503 with Retry-After
before their body is even read.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from config.schema import APIConfig
from engine_core.outputs import EngineCoreOutput
from observability.logging import get_logger
from services.api.auth import CACHE_SALT, APIKeys, auth_middleware
from services.api.chat_template import ChatTemplateError
from services.api.detokenizer import IncrementalDetokenizer
from services.api.engine_client import EngineClient, EngineDead, QueueFull
from services.api.openai_protocol import APIError, bad, unavailable
from services.api.openapi import openapi_document
from services.api.request_body import parse_json_object, read_body
from services.api.request_validation import RequestValidator, ValidationLimits, check_model
from services.api.response_format import (chat_chunk, chat_response, completion_chunk,
                                          completion_response, usage)
from services.api.request_trace import RequestTrace
from services.api.token_routes import TokenRoutes
from services.api.tokenizer import Tokenizer
from services.protocol import RequestRejected

VERSION = "0.1.0"
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
log = get_logger("services.api")


@dataclass(slots=True)
class SampleDelta:
    """New text of one sample since the last delta, and its end if it ended."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first delta)


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
        info = engine.model_info  # the model's own vocabulary bounds prompt token ids
        self.validator = RequestValidator(ValidationLimits(
            max_model_len, info.vocab_size if info is not None else tokenizer.vocab_size,
            self.api.max_n, self.api.max_stop_strings, self.api.max_logprobs))
        self.num_in_flight = 0  # generation requests being served now
        self.draining = False  # set on SIGTERM: finish what runs, refuse new work
        self._idle = asyncio.Event()
        self._idle.set()

    def begin_drain(self) -> None:
        """Refuse new generation requests (503); those in flight carry on."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def app(self) -> web.Application:
        public = {"/health", "/metrics"} if self.api.public_metrics else {"/health"}
        # auth first: a caller without a key learns nothing, not even that we are busy
        app = web.Application(middlewares=[auth_middleware(self.api_keys, public),
                                           self._errors],
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

    @web.middleware
    async def _errors(self, request, handler):
        generates = request.method == "POST" and request.path.startswith("/v1/")
        try:
            if not generates:
                return await handler(request)
            if self.draining:
                raise unavailable("the server is shutting down", "shutting_down")
            if self.engine.queue_state.is_full:  # refused before reading or tokenizing
                raise QueueFull(f"the server is at capacity "
                                f"({self.engine.queue_state.num_waiting} requests queued); "
                                f"retry later")
            self.num_in_flight += 1
            self._idle.clear()
            try:
                return await handler(request)
            finally:
                self.num_in_flight -= 1
                if self.num_in_flight == 0:
                    self._idle.set()
        except APIError as e:
            resp = web.json_response(e.body(), status=e.status)
            if e.status == 413:  # the refused body is never read: end the connection
                resp.force_close()
            return resp
        except web.HTTPException as e:
            err = APIError(e.status, e.reason or "error", type="invalid_request_error")
            return web.json_response(err.body(), status=e.status)
        except EngineDead as e:
            return web.json_response(unavailable(str(e)).body(), status=503)
        except QueueFull as e:
            return web.json_response(unavailable(str(e), "queue_full").body(), status=503,
                                     headers={"Retry-After": str(RETRY_AFTER_S)})
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # a bug: no traceback, path or input goes to the client
            resource = request.match_info.route.resource
            log.error("unhandled error", error=type(e).__name__,
                      route=resource.canonical if resource is not None else None)
            if request.writer is not None and request.writer.output_size > 0:
                raise  # a stream has begun: only dropping the connection is left
            err = APIError(500, "internal server error", "server_error")
            return web.json_response(err.body(), status=500)

    async def _body(self, request) -> dict:
        body = parse_json_object(await read_body(request, self.api.max_body_bytes))
        check_model(body, self.model_name)
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        checked = self.validator.completion(await self._body(request))
        prompt = checked.prompt

        def tokenize() -> list[int]:
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

        return await self._generate(request, checked, tokenize, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        checked = self.validator.chat(await self._body(request))

        def tokenize() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    checked.messages, add_generation_prompt=checked.add_generation_prompt)
            except ChatTemplateError as e:
                raise bad(str(e), "messages") from None
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await self._generate(request, checked, tokenize, chat=True)

    async def _generate(self, request, checked, tokenize, chat: bool) -> web.StreamResponse:
        """Tokenize, run and answer one request under its trace and log context."""
        operation, prefix = ("chat", "chatcmpl") if chat else ("text_completion", "cmpl")
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        params, stream, include_usage = checked.params, checked.stream, checked.include_usage
        trace = RequestTrace(self.tracer, operation, self.model_name, req_id,
                             request.headers.get("traceparent"), params)
        error = None
        with structlog.contextvars.bound_contextvars(request_id=req_id,
                                                     trace_id=trace.trace_id):
            try:
                with trace.tokenize():
                    ids = self.validator.check_prompt_ids(tokenize(), params,
                                                          checked.max_tokens_param)
                log.info("request received", operation=operation, num_prompt_tokens=len(ids),
                         max_tokens=params.max_tokens, n=params.n, stream=stream)
                trace.start_respond(len(ids), stream)
                fmt = dict(req_id=req_id, model=self.model_name, created=int(time.time()))
                chunk, response = (chat_chunk, chat_response) if chat else (completion_chunk,
                                                                            completion_response)
                if stream:
                    return await self._stream(request, req_id, ids, params, include_usage,
                                              lambda d: chunk(d, self.tokenizer, **fmt),
                                              fmt=fmt, chat=chat, trace=trace)
                samples = await self._collect(request, req_id, ids, params, trace)
                return web.json_response(response(samples, len(ids), self.tokenizer, **fmt))
            except BaseException as e:
                error = e
                raise
            finally:
                trace.finish(error)
                log.info("request finished", finish_reasons=trace.finish_reasons,
                         num_output_tokens=trace.num_output_tokens,
                         error=type(error).__name__ if error is not None else None)

    async def _deltas(self, request, req_id, ids, params, trace: RequestTrace):
        """Yield SampleDelta objects until every sample has finished."""
        sample_ids = [req_id] if params.n == 1 else [f"{i}_{req_id}" for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids,
                                         skip_special_tokens=params.skip_special_tokens,
                                         stop=params.stop,
                                         include_stop_str_in_output=params.include_stop_str_in_output)
                  for _ in sample_ids]
        live = set(range(len(sample_ids)))
        queue = await self.engine.add(req_id, ids, params, trace.traceparent,
                                      cache_salt=request.get(CACHE_SALT))
        try:
            while live:
                item = await queue.get()
                if item is None:
                    raise EngineDead("the engine core went away")
                if isinstance(item, RequestRejected):
                    if item.code == "queue_full":
                        raise QueueFull(item.message)
                    raise bad(item.message, item.param)
                trace.on_tokens(len(item.new_token_ids))
                t0 = time.perf_counter()
                delta = self._advance(item, detoks[item.index], live)
                trace.detokenize_seconds += time.perf_counter() - t0
                if delta.finish_reason is not None:
                    trace.finish_reasons.append(delta.finish_reason)
                if delta.finish_reason == "stop" and item.finish_reason is None:
                    await self.engine.abort([sample_ids[item.index]])  # stop string
                yield delta
        finally:
            self.engine.forget(req_id)
            if live:  # client went away or an error: free the engine's blocks
                await self.engine.abort([sample_ids[i] for i in live])

    @staticmethod
    def _advance(out: EngineCoreOutput, detok, live: set[int]) -> SampleDelta:
        if out.index not in live:
            return SampleDelta(out.index, "", [])
        d = detok.update(out.new_token_ids)
        text, finish = d.text, None
        if d.is_stopped:
            finish = "stop"
        elif out.finish_reason is not None:
            text += detok.finish().text
            finish = str(out.finish_reason)
        if finish is not None:
            live.discard(out.index)
        return SampleDelta(out.index, text, list(out.new_token_ids), out.new_logprobs or [],
                           finish, out.num_cached_tokens)

    async def _collect(self, request, req_id, ids, params, trace) -> list[SampleDelta]:
        samples = [SampleDelta(i, "", []) for i in range(params.n)]
        # aclosing: leaving early (client gone, handler cancelled) aborts at once
        async with contextlib.aclosing(self._deltas(request, req_id, ids, params,
                                                    trace)) as deltas:
            async for d in deltas:
                s = samples[d.index]
                s.text += d.text
                s.token_ids += d.token_ids
                s.logprobs += d.logprobs
                s.finish_reason = d.finish_reason or s.finish_reason
                s.num_cached_tokens = max(s.num_cached_tokens, d.num_cached_tokens)
                if request.transport is None or request.transport.is_closing():
                    break  # the client hung up
        return samples

    async def _stream(self, request, req_id, ids, params, include_usage, render, fmt,
                      chat, trace) -> web.StreamResponse:
        gen = self._deltas(request, req_id, ids, params, trace)
        try:
            return await self._write_stream(request, gen, req_id, ids, params,
                                            include_usage, render, fmt, chat)
        finally:  # also on cancellation (client gone): aborts what is still live
            await gen.aclose()

    async def _write_stream(self, request, gen, req_id, ids, params, include_usage, render,
                            fmt, chat) -> web.StreamResponse:
        first_delta = await gen.__anext__()  # rejections become HTTP errors, not SSE
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        num_tokens = num_cached = 0
        try:
            if chat:
                for i in range(params.n):
                    await _sse(resp, chat_chunk(SampleDelta(i, "", []), self.tokenizer,
                                                role=True, **fmt))
            delta = first_delta
            while True:
                num_tokens += len(delta.token_ids)
                if delta.index == 0:
                    num_cached = max(num_cached, delta.num_cached_tokens)
                if delta.text or delta.finish_reason or delta.token_ids:
                    await _sse(resp, render(delta))
                delta = await gen.__anext__()
        except StopAsyncIteration:
            pass
        except ConnectionResetError:
            return resp
        except EngineDead as e:  # the stream ends with an error event, not [DONE]
            await _sse(resp, unavailable(str(e)).body())
            return resp
        if include_usage:
            await _sse(resp, {"id": req_id, "object": "chat.completion.chunk" if chat
                              else "text_completion", "created": fmt["created"],
                              "model": self.model_name, "choices": [],
                              "usage": usage(len(ids), num_tokens, num_cached)})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "folio",
            "max_model_len": self.max_model_len}]})

    async def health(self, request) -> web.Response:
        """200 with the engine core's gauges when it answers; 503 when it does not, or
        while this process drains."""
        if self.draining:
            raise unavailable("the server is shutting down", "shutting_down")
        try:
            reply = await self.engine.health()
        except (EngineDead, asyncio.TimeoutError):
            raise unavailable("the engine core is unavailable")
        if not reply.ok:
            raise unavailable("the engine core has failed")
        return web.json_response({"status": "ok", "engine": reply.detail,
                                  "api": {"num_in_flight": self.num_in_flight}})

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


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
