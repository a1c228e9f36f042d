"""One completion or chat request, from its validated body to its last byte.

    Generation.respond(request)
      [compile the grammar] ─▶ tokenize (chat template) ─▶ fit check ─▶ engine.add
      ─▶ deltas() ─┬─ JSON: collect, render output (tool calls: tool_calls.py)
                   └─ SSE: a chunk per delta
Each engine output goes through the request's ``RequestState`` (text/request_state.py),
the same code the offline ``LLM`` runs: incremental text, stop strings, logprobs and
``n`` > 1. A sample that a stop string ends is aborted in the engine; when the client
goes away (or anything fails) every live sample is aborted, so its KV blocks are freed.
"""
from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from observability.logging import get_logger
from services.api.engine_client import EngineDead, QueueFull
from services.api.completion_choices import CompletionChoices
from services.api.grammar_check import GrammarChecker
from services.api.openai_protocol import APIError, bad, unavailable
from services.api.queue_merge import MergedQueues
from services.api.request_trace import RequestTrace
from services.api.request_validation import CheckedRequest, RequestValidator
from services.api.response_format import (chat_chunk, chat_response, completion_chunk,
                                          completion_response, output_usage)
from services.api.tool_calls import ToolCallStream
from services.protocol import RequestRejected
from text.request_output import RequestOutput
from text.request_state import RequestState, SampleDelta
from text.tokenizer import Tokenizer

log = get_logger("services.api")


@dataclass(slots=True)
class Generation:
    """Everything one request needs while it is served (see the module docstring)."""

    engine: object  # EngineClient
    tokenizer: Tokenizer
    validator: RequestValidator
    model_name: str
    checked: CheckedRequest
    chat: bool
    trace: RequestTrace
    req_id: str
    grammars: GrammarChecker | None = None  # compiles structured-output grammars
    cache_salt: str | None = None
    tenant: str | None = None  # the API key's tenant id, None without keys
    tenant_weight: float = 1.0
    lora_name: str | None = None  # the LoRA adapter the request names (model_name too)
    created: int = field(default_factory=lambda: int(time.time()))
    states: list[RequestState] = field(default_factory=list)  # one per prompt
    choices: CompletionChoices | None = None  # completions: renders the choices
    # per prompt: whether truncate_prompt_tokens cut it
    truncated: list[bool] = field(default_factory=list)

    @classmethod
    def start(cls, request: web.Request, checked: CheckedRequest, chat: bool,
              **shared) -> "Generation":
        """A new request's object, with its id and trace (``shared``: the server's
        engine, tokenizer, validator, model_name and tracer)."""
        operation, prefix = ("chat", "chatcmpl") if chat else ("text_completion", "cmpl")
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        tracer = shared.pop("tracer")
        trace = RequestTrace(tracer, operation, shared["model_name"], req_id,
                             request.headers.get("traceparent"), checked.params,
                             shared.get("lora_name"))
        return cls(checked=checked, chat=chat, trace=trace, req_id=req_id, **shared)

    @property
    def operation(self) -> str:
        return "chat" if self.chat else "text_completion"

    async def respond(self, request: web.Request,
                      tokenize: Callable[[], Awaitable[list[list[int]]]]
                      ) -> web.StreamResponse:
        """Tokenize, run and answer the request under its trace and log context;
        ``tokenize`` gives one token-id list per prompt (several: a batched completion)."""
        error = None
        with structlog.contextvars.bound_contextvars(request_id=self.req_id,
                                                     trace_id=self.trace.trace_id):
            try:
                params = self.checked.params
                await self._check_grammar()
                with self.trace.tokenize():
                    tokenized = await tokenize()
                    prompts = [self.validator.check_prompt_ids(
                        self.checked.truncated(ids), params, self.checked.max_tokens_param)
                        for ids in tokenized]
                # an echo shows what the model read: a truncated prompt's own text is not
                self.truncated = [len(p) < len(ids) for p, ids in zip(prompts, tokenized)]
                num_prompt_tokens = sum(map(len, prompts))
                log.info("request received", operation=self.operation,
                         num_prompt_tokens=num_prompt_tokens, num_prompts=len(prompts),
                         max_tokens=params.max_tokens, n=params.n,
                         stream=self.checked.stream, lora_adapter=self.lora_name)
                self.trace.start_respond(num_prompt_tokens, self.checked.stream)
                if self.checked.stream:
                    return await self._stream(request, prompts)
                return web.json_response(await self._collect(request, prompts))
            except BaseException as e:
                error = e
                raise
            finally:
                self.trace.finish(error)
                log.info("request finished", finish_reasons=self.trace.finish_reasons,
                         num_output_tokens=self.trace.num_output_tokens,
                         error=type(error).__name__ if error is not None else None)

    async def _check_grammar(self) -> None:
        """Compile the request's grammar (cached by spec): a 400 before anything is
        tokenized or sent when it does not compile in time."""
        structured = self.checked.structured
        if structured is None or self.grammars is None:
            return
        spec = structured.params.spec
        with self.trace.child("structured_output.compile") as span:
            t0 = time.perf_counter()
            cached = await self.grammars.check(spec, structured.param)
            if span is not None:
                span.set_attributes({"folio.grammar_kind": structured.params.kind,
                                     "folio.cache_hit": cached,
                                     "folio.compile_seconds": time.perf_counter() - t0})

    def _format(self) -> dict:
        return dict(req_id=self.req_id, model=self.model_name, created=self.created)

    @property
    def outputs(self) -> list[RequestOutput]:
        """Each prompt's output so far, in prompt order."""
        return [state.output for state in self.states]

    def _choices(self) -> CompletionChoices:
        if self.choices is None:
            cut = self.truncated
            self.choices = CompletionChoices(
                self.tokenizer, self.checked.options,
                [p if isinstance(p, str) and not (k < len(cut) and cut[k]) else None
                 for k, p in enumerate(self.checked.prompts or [])],
                self.checked.params.skip_special_tokens)
        return self.choices

    def _usage(self) -> dict:
        return output_usage(self.outputs, count_output=not self.checked.options.discard_output)

    def _sub_id(self, k: int, num_prompts: int) -> str:
        return self.req_id if num_prompts == 1 else f"{self.req_id}-{k}"

    async def _add(self, k: int, num_prompts: int, ids: list[int]):
        params = self.checked.params
        sub_id = self._sub_id(k, num_prompts)
        queue = await self.engine.add(sub_id, ids, params, self.trace.traceparent,
                                      cache_salt=self.cache_salt, tenant=self.tenant,
                                      tenant_weight=self.tenant_weight,
                                      lora_name=self.lora_name,
                                      batch_id=self.req_id if num_prompts > 1 else None)
        self.trace.on_replica(self.engine.replica_of(sub_id))
        child_ids = ([sub_id] if params.n == 1
                     else [f"{i}_{sub_id}" for i in range(params.n)])
        self.states.append(RequestState(self.tokenizer, sub_id, None, ids, params,
                                        child_ids))
        return queue

    async def deltas(self, prompts: list[list[int]]) -> AsyncIterator[SampleDelta]:
        """Send each prompt to the engine; yield every sample's deltas until all ended.

        Sample i of prompt k is choice ``k * n + i`` (OpenAI's order for a batch)."""
        n = self.checked.params.n
        self.states = []
        merged = None
        try:
            queues = [await self._add(k, len(prompts), ids) for k, ids in enumerate(prompts)]
            merged = MergedQueues(queues)
            while not all(state.finished for state in self.states):
                k, item = await merged.get()
                if item is None:
                    raise EngineDead("the engine core went away")
                if isinstance(item, RequestRejected):
                    if item.code == "queue_full":
                        raise QueueFull(item.message)
                    if item.code == "sleeping":
                        raise unavailable(item.message, "sleeping")
                    if item.code == "model_not_found":
                        raise APIError(404, item.message, "not_found_error", item.param,
                                       item.code)
                    raise bad(item.message, item.param)
                self.trace.on_tokens(len(item.new_token_ids))
                t0 = time.perf_counter()
                delta = self.states[k].update(item)
                self.trace.detokenize_seconds += time.perf_counter() - t0
                if delta is None:
                    continue
                if delta.finish_reason is not None:
                    self.trace.finish_reasons.append(delta.finish_reason)
                if delta.abort_in_engine:  # a stop string ended it
                    await self.engine.abort([item.req_id])
                delta.index += k * n
                yield delta
        finally:
            if merged is not None:
                merged.close()
            live = []
            for k, state in enumerate(self.states):
                self.engine.forget(state.req_id)
                live += state.live_child_ids
            if live:  # client went away or an error: free the engine's blocks
                await self.engine.abort(live)

    async def _collect(self, request: web.Request, prompts: list[list[int]]) -> dict:
        # aclosing: leaving early (client gone, handler cancelled) aborts at once
        async with contextlib.aclosing(self.deltas(prompts)) as deltas:
            async for _ in deltas:
                if request.transport is None or request.transport.is_closing():
                    break  # the client hung up
        if self.chat:
            return chat_response(self.outputs, self.tokenizer, self.checked,
                                 tools=self._tools, **self._format())
        return completion_response(self._choices(), self.outputs, **self._format())

    @property
    def _tools(self):
        structured = self.checked.structured
        return structured.tools if structured is not None else None

    async def _stream(self, request: web.Request,
                      prompts: list[list[int]]) -> web.StreamResponse:
        gen = self.deltas(prompts)
        try:
            return await self._write_stream(request, gen)
        finally:  # also on cancellation (client gone): aborts what is still live
            await gen.aclose()

    async def _write_stream(self, request: web.Request,
                            gen: AsyncIterator[SampleDelta]) -> web.StreamResponse:
        first_delta = await gen.__anext__()  # rejections become HTTP errors, not SSE
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        fmt = self._format()
        tools = self._tools
        calls = {i: ToolCallStream(tools) for i in range(self.checked.params.n)} if tools \
            else None
        try:
            if self.chat:
                for i in range(self.checked.params.n):
                    await _sse(resp, chat_chunk(SampleDelta(i, "", []), self.tokenizer,
                                                self.checked, self.outputs[0], role=True,
                                                **fmt))
            delta = first_delta
            while True:
                if calls is not None:
                    for payload in _tool_chunks(calls[delta.index], delta, fmt):
                        await _sse(resp, payload)
                else:
                    for payload in self._chunks(delta, fmt):
                        if self.checked.continuous_usage:  # the request's usage so far
                            payload["usage"] = self._usage()
                        await _sse(resp, payload)
                delta = await gen.__anext__()
        except StopAsyncIteration:
            pass
        except ConnectionResetError:
            return resp
        except EngineDead as e:  # the stream ends with an error event, not [DONE]
            await _sse(resp, unavailable(str(e)).body())
            return resp
        if self.checked.include_usage:
            await _sse(resp, {"id": self.req_id, "object": "chat.completion.chunk"
                              if self.chat else "text_completion", "created": self.created,
                              "model": self.model_name, "choices": [],
                              "usage": self._usage()})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _chunks(self, delta: SampleDelta, fmt: dict) -> list[dict]:
        """The stream events of one delta (none when it shows nothing). A completion
        choice's echoed prompt and its first tokens go in two events: an event holds
        one entry per choice index, as OpenAI's streams do."""
        if self.chat:
            if delta.text or delta.finish_reason or delta.token_ids:
                return [chat_chunk(delta, self.tokenizer, self.checked, self.outputs[0],
                                   **fmt)]
            return []
        k = delta.index // self.checked.params.n
        return [completion_chunk([choice], **fmt)
                for choice in self._choices().chunk(delta, k, self.outputs[k])]


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def _tool_chunks(stream: ToolCallStream, delta: SampleDelta, fmt: dict) -> list[dict]:
    """The chunks of one delta of a tool-call sample (the finish rides on the last)."""
    bodies, finish = stream.deltas(delta.text, delta.finish_reason)
    if finish is not None and not bodies:
        bodies = [{}]
    return [{"id": fmt["req_id"], "object": "chat.completion.chunk",
             "created": fmt["created"], "model": fmt["model"],
             "choices": [{"index": delta.index, "delta": body, "logprobs": None,
                          "finish_reason": finish if i == len(bodies) - 1 else None}]}
            for i, body in enumerate(bodies)]
