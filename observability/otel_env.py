"""OpenTelemetry's standard environment, merged with the YAML: what a service exports.

Every OTel-instrumented service honours the ``OTEL_*`` variables, so an operator can
turn tracing on without touching Folio's YAML. Each setting resolves on its own; the
first source that sets it wins (YAML, then environment, then default):

- endpoint: ``observability.otlp_endpoint``; ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used
  as is), then ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` added for HTTP), both
  ignored with ``OTEL_SDK_DISABLED=true``; else none: tracing off.
- protocol: ``observability.otlp_protocol``; ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, then
  ``OTEL_EXPORTER_OTLP_PROTOCOL``; else http/protobuf.
- sampler: ``observability.trace_sample_ratio`` (a parent-based ratio);
  ``OTEL_TRACES_SAMPLER`` with ``OTEL_TRACES_SAMPLER_ARG``; else parent-based always-on.
- service name: ``OTEL_SERVICE_NAME``, then ``service.name`` in
  ``OTEL_RESOURCE_ATTRIBUTES``, as a prefix (``<name>-api``); else ``folio``.
- resource attributes: ``OTEL_RESOURCE_ATTRIBUTES``.

A value Folio cannot serve (``http/json``, a sampler it does not know, a ratio outside
[0, 1]) is a ConfigError naming the variable: the service refuses to start rather than
silently exporting nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import unquote

from config.schema import OTLP_PROTOCOLS, ConfigError, ObservabilityConfig

SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")
DEFAULT_SERVICE_PREFIX = "folio"


@dataclass(frozen=True, slots=True)
class OTelSettings:
    """What one service's tracer provider is built from (``endpoint`` None: tracing off).

    ``endpoint`` is the full URL spans are sent to (for HTTP it ends in the traces path).
    ``sampler`` is one of SAMPLERS and ``ratio`` its argument for the ratio samplers.
    """

    endpoint: str | None
    protocol: str = "http/protobuf"
    sampler: str = "parentbased_traceidratio"
    ratio: float = 1.0
    service_name: str = "folio"
    resource_attributes: dict[str, str] = field(default_factory=dict)


def resolve(config: ObservabilityConfig, service: str,
            environ: Mapping[str, str] | None = None) -> OTelSettings:
    """The settings of ``service`` (``api``, ``engine-core``, ``worker``)."""
    env = os.environ if environ is None else environ
    attributes = parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    prefix = (env.get("OTEL_SERVICE_NAME", "").strip()
              or attributes.pop("service.name", "").strip() or DEFAULT_SERVICE_PREFIX)
    attributes.pop("service.name", None)
    protocol = config.otlp_protocol or _env_protocol(env)
    sampler, ratio = _sampler(config, env)
    return OTelSettings(endpoint=_endpoint(config, env, protocol), protocol=protocol,
                        sampler=sampler, ratio=ratio, service_name=f"{prefix}-{service}",
                        resource_attributes=attributes)


def parse_resource_attributes(raw: str) -> dict[str, str]:
    """``key1=value1,key2=value2`` (values percent-encoded) → dict; malformed pairs are
    skipped, as the OTel SDKs do."""
    out = {}
    for pair in raw.split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            out[key.strip()] = unquote(value.strip())
    return out


def _env_protocol(env: Mapping[str, str]) -> str:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(name, "").strip().lower()
        if value:
            if value not in OTLP_PROTOCOLS:
                raise ConfigError(f"{name}={value!r}: Folio exports OTLP as one of "
                                  f"{OTLP_PROTOCOLS}", name)
            return value
    return "http/protobuf"


def _endpoint(config: ObservabilityConfig, env: Mapping[str, str], protocol: str) -> str | None:
    if config.otlp_endpoint is not None:
        return _with_traces_path(config.otlp_endpoint, protocol)
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    signal = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if signal:
        return signal  # the spec: a per-signal endpoint is used exactly as given
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return _with_traces_path(base, protocol) if base else None


def _with_traces_path(endpoint: str, protocol: str) -> str:
    endpoint = endpoint.rstrip("/")
    if protocol == "grpc" or endpoint.endswith("/v1/traces"):
        return endpoint
    return endpoint + "/v1/traces"


def _sampler(config: ObservabilityConfig, env: Mapping[str, str]) -> tuple[str, float]:
    if config.trace_sample_ratio is not None:
        return "parentbased_traceidratio", config.trace_sample_ratio
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if name not in SAMPLERS:
        raise ConfigError(f"OTEL_TRACES_SAMPLER={name!r}: Folio knows {SAMPLERS}",
                          "OTEL_TRACES_SAMPLER")
    ratio = 1.0
    raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if name.endswith("traceidratio") and raw:
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r}: the ratio must be a number "
                              "in [0, 1]", "OTEL_TRACES_SAMPLER_ARG")
    return name, ratio


def make_sampler(settings: OTelSettings):
    """The SDK sampler named by ``settings`` (imports the SDK)."""
    from opentelemetry.sdk.trace.sampling import (ALWAYS_OFF, ALWAYS_ON, ParentBased,
                                                  TraceIdRatioBased)
    base = settings.sampler.removeprefix("parentbased_")
    root = {"always_on": ALWAYS_ON, "always_off": ALWAYS_OFF}.get(base)
    if root is None:
        root = TraceIdRatioBased(settings.ratio)
    return ParentBased(root) if settings.sampler.startswith("parentbased_") else root
