"""OpenTelemetry tracing for one service: a tracer exporting over OTLP, or nothing.

With no endpoint (``observability.otlp_endpoint`` null and no ``OTEL_EXPORTER_OTLP_*``
endpoint in the environment), ``Tracing.tracer`` is None, the SDK is never imported,
and every caller skips its span work behind one ``if``: tracing off costs nothing
measurable. With one, each service exports its spans in batches (OTLP over HTTP or
gRPC) under ``service.name = folio-<service>`` (``OTEL_SERVICE_NAME`` replaces the
prefix); sampling is decided once per request at the API (``ParentBased(TraceIdRatioBased)``
by default) and followed downstream through the W3C ``traceparent`` carried inside the
internal messages.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from config.schema import ObservabilityConfig
from observability.otel_env import OTelSettings, make_sampler, resolve

TRACEPARENT_VERSION = "00"


class Tracing:
    """One service's tracer provider (``tracer`` is None when tracing is off).

    ``settings`` merge the YAML with OpenTelemetry's standard environment (see otel_env).
    ``replica``: the data-parallel replica this engine core or worker serves, a resource
    attribute (``folio.replica``) of every span it exports.
    """

    def __init__(self, config: ObservabilityConfig, service: str,
                 environ: Mapping[str, str] | None = None, replica: int | None = None):
        self.config = config
        self.service = service
        self.settings = resolve(config, service, environ)
        self.tracer = None
        self._provider = None
        if self.settings.endpoint is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        # Resource.create also reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME;
        # the attributes given here (resolved from the same variables) take precedence.
        self._sampler = _retunable_sampler(self.settings)
        self._provider = TracerProvider(
            resource=Resource.create({**self.settings.resource_attributes,
                                      "service.name": self.settings.service_name,
                                      "service.namespace": "folio",
                                      **({} if replica is None
                                         else {"folio.replica": replica})}),
            sampler=self._sampler)
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(self.settings)))
        self.tracer = self._provider.get_tracer("folio")

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def set_sample_ratio(self, ratio: float | None) -> None:
        """Sample this fraction of new traces from now on (a live retune); None: the
        ratio the environment or the default gave at start (``settings.ratio``)."""
        if self._provider is not None:
            self._sampler.set_ratio(self.settings.ratio if ratio is None else ratio)

    def shutdown(self) -> None:
        """Flush what is buffered and stop exporting."""
        if self._provider is not None:
            self._provider.shutdown()


# Spans of operator actions, recorded whatever the sample ratio (they are rare).
ALWAYS_SAMPLED_SPANS = frozenset({"config.reload"})


def _retunable_sampler(settings: OTelSettings):
    """The sampler ``settings`` name (otel_env.make_sampler), whose ratio can change
    while spans are being started (one attribute swap; a span sees the old or the new
    sampler)."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler

    class RetunableSampler(Sampler):
        def __init__(self):
            self.set_ratio(settings.ratio)

        def set_ratio(self, value: float) -> None:
            self.ratio = value
            self._inner = make_sampler(replace(settings, ratio=value))

        def should_sample(self, parent_context, trace_id, name, *args, **kwargs):
            inner = ALWAYS_ON if name in ALWAYS_SAMPLED_SPANS else self._inner
            return inner.should_sample(parent_context, trace_id, name, *args, **kwargs)

        def get_description(self) -> str:
            return f"Retunable{{{self._inner.get_description()}}}"

    return RetunableSampler()


def _exporter(settings: OTelSettings):
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=settings.endpoint,
                                insecure=settings.endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=settings.endpoint)


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
