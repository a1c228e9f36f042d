"""OpenTelemetry tracing for one service: a tracer exporting over OTLP, or nothing.

With ``observability.otlp_endpoint`` null, ``Tracing.tracer`` is None, the SDK is never
imported, and every caller skips its span work behind one ``if``: tracing off costs
nothing measurable. With it set, each service exports its spans in batches (OTLP over
HTTP or gRPC) under ``service.name = folio-<service>``; sampling is decided once per
request at the API (``ParentBased(TraceIdRatioBased)``) and followed downstream through
the W3C ``traceparent`` carried inside the internal messages.
"""
from __future__ import annotations

from typing import Any

from config.schema import ObservabilityConfig

TRACEPARENT_VERSION = "00"


class Tracing:
    """One service's tracer provider (``tracer`` is None when tracing is off)."""

    def __init__(self, config: ObservabilityConfig, service: str):
        self.config = config
        self.service = service
        self.tracer = None
        self._provider = None
        if config.otlp_endpoint is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        self._sampler = _retunable_sampler(config.trace_sample_ratio)
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": f"folio-{service}",
                                      "service.namespace": "folio"}),
            sampler=self._sampler)
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
        self.tracer = self._provider.get_tracer("folio")

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def set_sample_ratio(self, ratio: float) -> None:
        """Sample this fraction of new traces from now on (a live retune)."""
        if self._provider is not None:
            self._sampler.set_ratio(ratio)

    def shutdown(self) -> None:
        """Flush what is buffered and stop exporting."""
        if self._provider is not None:
            self._provider.shutdown()


# Spans of operator actions, recorded whatever the sample ratio (they are rare).
ALWAYS_SAMPLED_SPANS = frozenset({"config.reload"})


def _retunable_sampler(ratio: float):
    """``ParentBased(TraceIdRatioBased(ratio))`` whose ratio can change while spans are
    being started (one attribute swap; a span sees the old or the new sampler)."""
    from opentelemetry.sdk.trace.sampling import (ALWAYS_ON, ParentBased, Sampler,
                                                  TraceIdRatioBased)

    class RetunableSampler(Sampler):
        def __init__(self):
            self.set_ratio(ratio)

        def set_ratio(self, value: float) -> None:
            self.ratio = value
            self._inner = ParentBased(TraceIdRatioBased(value))

        def should_sample(self, parent_context, trace_id, name, *args, **kwargs):
            inner = ALWAYS_ON if name in ALWAYS_SAMPLED_SPANS else self._inner
            return inner.should_sample(parent_context, trace_id, name, *args, **kwargs)

        def get_description(self) -> str:
            return f"Retunable{{{self._inner.get_description()}}}"

    return RetunableSampler()


def _exporter(config: ObservabilityConfig):
    endpoint = config.otlp_endpoint.rstrip("/")
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    if not endpoint.endswith("/v1/traces"):
        endpoint += "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


def traceparent_of(span: Any) -> str | None:
    """The W3C traceparent of ``span`` (None for an invalid span context)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"{TRACEPARENT_VERSION}-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace_id, span_id, sampled) of a W3C traceparent; None if it is not a valid one."""
    if not value or len(value) > 256:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    version, trace_hex, span_hex, flags_hex = parts[:4]
    if version == TRACEPARENT_VERSION and len(parts) != 4:
        return None
    if len(trace_hex) != 32 or len(span_hex) != 16 or len(flags_hex) != 2:
        return None
    try:
        trace_id, span_id, flags = int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, bool(flags & 1)


def context_from_traceparent(value: str | None):
    """An OpenTelemetry Context whose parent is ``value``'s span (None when invalid)."""
    parsed = parse_traceparent(value)
    if parsed is None:
        return None
    from opentelemetry import trace
    trace_id, span_id, sampled = parsed
    parent = trace.SpanContext(trace_id, span_id, is_remote=True,
                               trace_flags=trace.TraceFlags(1 if sampled else 0))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def is_sampled(traceparent: str | None) -> bool:
    parsed = parse_traceparent(traceparent)
    return parsed is not None and parsed[2]


def link_to(traceparent: str):
    """A span link to the span named by ``traceparent`` (which must be valid)."""
    from opentelemetry import trace
    trace_id, span_id, sampled = parse_traceparent(traceparent)
    return trace.Link(trace.SpanContext(trace_id, span_id, is_remote=True,
                                        trace_flags=trace.TraceFlags(1 if sampled else 0)))
