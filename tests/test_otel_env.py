"""How OpenTelemetry's standard environment merges with the YAML (observability.otel_env)."""
import pytest

from config.schema import ConfigError, ObservabilityConfig
from observability.otel_env import parse_resource_attributes, resolve

OFF = ObservabilityConfig()  # tracing off in the YAML, every OTel key null


def test_nothing_set_is_tracing_off_with_folio_defaults():
    s = resolve(OFF, "api", {})
    assert s.endpoint is None and s.protocol == "http/protobuf"
    assert s.service_name == "folio-api" and s.sampler == "parentbased_always_on"


def test_generic_endpoint_gets_the_traces_path_and_signal_endpoint_is_used_as_is():
    assert resolve(OFF, "api", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}).endpoint \
        == "http://c:4318/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9999/custom"}
    assert resolve(OFF, "api", env).endpoint == "http://t:9999/custom"
    grpc = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    s = resolve(OFF, "worker", grpc)
    assert (s.endpoint, s.protocol) == ("http://c:4317", "grpc")


def test_the_yaml_wins_where_both_are_set():
    yaml = ObservabilityConfig(otlp_endpoint="http://yaml:4318", otlp_protocol="http/protobuf",
                               trace_sample_ratio=0.25)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_TRACES_SAMPLER": "always_off", "OTEL_SDK_DISABLED": "true"}
    s = resolve(yaml, "engine-core", env)
    assert (s.endpoint, s.protocol) == ("http://yaml:4318/v1/traces", "http/protobuf")
    assert (s.sampler, s.ratio) == ("parentbased_traceidratio", 0.25)


def test_sdk_disabled_drops_the_environment_s_endpoint():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318", "OTEL_SDK_DISABLED": "TRUE"}
    assert resolve(OFF, "api", env).endpoint is None


def test_service_name_is_a_prefix_and_resource_attributes_are_kept():
    env = {"OTEL_SERVICE_NAME": "shop",
           "OTEL_RESOURCE_ATTRIBUTES": "service.name=ignored, team=ml%2Cops,broken,=x"}
    s = resolve(OFF, "engine-core", env)
    assert s.service_name == "shop-engine-core"
    assert s.resource_attributes == {"team": "ml,ops"}
    # without OTEL_SERVICE_NAME, service.name in the attributes is the prefix (the spec's order)
    only_attr = resolve(OFF, "worker", {"OTEL_RESOURCE_ATTRIBUTES": "service.name=lab"})
    assert only_attr.service_name == "lab-worker" and only_attr.resource_attributes == {}
    assert parse_resource_attributes("") == {}


def test_samplers_from_the_environment():
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from observability.otel_env import make_sampler
    s = resolve(OFF, "api", {"OTEL_TRACES_SAMPLER": "traceidratio",
                             "OTEL_TRACES_SAMPLER_ARG": "0.1"})
    assert (s.sampler, s.ratio) == ("traceidratio", 0.1)
    sampler = make_sampler(s)
    assert isinstance(sampler, TraceIdRatioBased) and sampler.rate == 0.1
    parent = make_sampler(resolve(OFF, "api", {"OTEL_TRACES_SAMPLER": "parentbased_always_off"}))
    assert isinstance(parent, ParentBased) and "AlwaysOff" in parent.get_description()


@pytest.mark.parametrize("env, name", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "kafka"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ({"OTEL_TRACES_SAMPLER": "xray"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
     "OTEL_TRACES_SAMPLER_ARG"),
])
def test_values_folio_cannot_serve_are_errors_naming_the_variable(env, name):
    with pytest.raises(ConfigError) as err:
        resolve(OFF, "api", env)
    assert err.value.key == name and name in str(err.value)


def test_tracing_built_from_the_environment_alone():
    from observability.tracing import Tracing
    tracing = Tracing(OFF, "api", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                   "OTEL_SERVICE_NAME": "svc"})
    try:
        assert tracing.enabled
        assert tracing._provider.resource.attributes["service.name"] == "svc-api"
    finally:
        tracing.shutdown()
    assert not Tracing(OFF, "api", {}).enabled


def test_a_data_parallel_replica_marks_every_span_it_exports():
    from observability.tracing import Tracing
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    tracing = Tracing(OFF, "engine-core", env, replica=1)
    single = Tracing(OFF, "engine-core", env)
    try:
        assert tracing._provider.resource.attributes["folio.replica"] == 1
        assert "folio.replica" not in single._provider.resource.attributes
    finally:
        tracing.shutdown()
        single.shutdown()
