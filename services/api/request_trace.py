"""One API request's trace: the root span (OpenTelemetry GenAI conventions) and its
``structured_output.compile``, ``tokenize`` and ``api.respond`` children, plus the ids
its log lines carry.

With tracing off every method is a no-op, but the request still gets a W3C trace id
(the client's ``traceparent`` if it sent one) so that its log lines in every service
can be joined.
"""
from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

from engine_core.sampling_params import SamplingParams
from observability.tracing import context_from_traceparent, parse_traceparent, traceparent_of


class RequestTrace:
    """Spans of one request in the API process (``span`` is None when not recording)."""

    def __init__(self, tracer, operation: str, model: str, req_id: str,
                 client_traceparent: str | None, params: SamplingParams,
                 lora_name: str | None = None):
        self.tracer = tracer
        self.span = None
        self._respond = None
        self._first_token_ns: int | None = None
        self._start_ns = time.time_ns()
        self.detokenize_seconds = 0.0
        self.num_output_tokens = 0
        self.finish_reasons: list[str] = []
        self.replicas: list[int] = []  # data parallelism: each prompt's replica
        if tracer is not None:
            self.span = tracer.start_span(
                f"{operation} {model}", context=context_from_traceparent(client_traceparent),
                kind=_server_kind(), start_time=self._start_ns,
                attributes=_request_attributes(operation, model, req_id, params))
            if lora_name is not None:
                self.span.set_attribute("folio.lora_adapter", lora_name)
            self.traceparent = traceparent_of(self.span)
        else:
            self.traceparent = (client_traceparent if parse_traceparent(client_traceparent)
                                 else f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00")
        self.trace_id = self.traceparent.split("-")[1]

    def _child(self, name: str, **kw):
        from opentelemetry import trace
        return self.tracer.start_span(name, context=trace.set_span_in_context(self.span), **kw)

    @contextlib.contextmanager
    def child(self, name: str):
        """A child span of the request (None when not recording), ended on exit."""
        if self.span is None:
            yield None
            return
        span = self._child(name)
        try:
            yield span
        finally:
            span.end()

    def tokenize(self):
        """Span around the chat template and tokenization."""
        return self.child("tokenize")

    def start_respond(self, num_prompt_tokens: int, stream: bool) -> None:
        """The request reached the engine: from here to the finish is api.respond."""
        if self.span is None:
            return
        self.span.set_attribute("gen_ai.usage.input_tokens", num_prompt_tokens)
        self._respond = self._child("api.respond", attributes={"folio.stream": stream})

    def on_replica(self, replica: int | None) -> None:
        """A prompt went to data-parallel replica ``replica`` (None: only one replica):
        ``folio.replica`` holds it, or every prompt's replica for a batch that split."""
        if replica is None or self.span is None:
            return
        self.replicas.append(replica)
        value = replica if len(set(self.replicas)) == 1 else list(self.replicas)
        self.span.set_attribute("folio.replica", value)

    def on_tokens(self, num_tokens: int) -> None:
        self.num_output_tokens += num_tokens
        if num_tokens and self._first_token_ns is None:
            self._first_token_ns = time.time_ns()
            if self.span is not None:
                self.span.set_attribute("gen_ai.server.time_to_first_token",
                                        (self._first_token_ns - self._start_ns) / 1e9)

    def finish(self, error: BaseException | None = None) -> None:
        """End every open span (idempotent); ``error`` marks the root span failed."""
        if self.span is None:
            return
        if self._respond is not None:
            self._respond.set_attribute("folio.detokenize_seconds", self.detokenize_seconds)
            self._respond.end()
        self.span.set_attributes({"gen_ai.usage.output_tokens": self.num_output_tokens,
                                  "gen_ai.response.finish_reasons": self.finish_reasons})
        if error is not None:
            from opentelemetry.trace import Status, StatusCode
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self.span.end()
        self.span = None


def _server_kind():
    from opentelemetry.trace import SpanKind
    return SpanKind.SERVER


def _request_attributes(operation: str, model: str, req_id: str,
                        params: SamplingParams) -> dict[str, Any]:
    attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "folio",
                  "gen_ai.request.model": model, "gen_ai.response.model": model,
                  "gen_ai.response.id": req_id,
                  "gen_ai.request.max_tokens": params.max_tokens,
                  "gen_ai.request.temperature": params.temperature,
                  "gen_ai.request.top_p": params.top_p,
                  "gen_ai.request.choice.count": params.n}
    if params.top_k:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    return attributes
