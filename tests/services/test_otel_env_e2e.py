"""OpenTelemetry's standard environment end to end: with tracing off in the YAML
(``otlp_endpoint: null``) and only ``OTEL_EXPORTER_OTLP_ENDPOINT`` (plus the service
name and resource attributes) in the environment, a request's spans from all three
services reach an OTLP receiver."""
import openai

from observability.otlp_receiver import OTLPReceiver
from tests.services.serve_process import running, write_config

MODEL = "folio-tiny"


def test_env_only_endpoint_exports_every_service_s_spans(tiny_llama_dir, default_model_path,
                                                          tmp_path):
    receiver = OTLPReceiver()
    config = write_config(tmp_path / "folio.yaml", str(tiny_llama_dir),
                          str(default_model_path),
                          observability={"otlp_endpoint": None, "log_level": "warning"})
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "shop",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        with running(config, tmp_path, env=env) as serve:
            reply = openai.OpenAI(base_url=serve.url + "/v1", api_key="none",
                                  max_retries=0).completions.create(
                model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                extra_body={"ignore_eos": True})

            def complete(spans):  # every service's spans, engine.request (it ends last,
                # so it may come in a later export batch than the rest) included
                roots = [s for s in spans if s.attributes.get("gen_ai.response.id") == reply.id]
                return roots and {"shop-api", "shop-engine-core", "shop-worker"} <= {
                    s.service for s in spans if s.trace_id == roots[0].trace_id
                    or s.name == "worker.execute"} and "engine.request" in {
                    s.name for s in spans if s.trace_id == roots[0].trace_id}
            spans = receiver.wait_for(complete)
        root = next(s for s in spans if s.attributes.get("gen_ai.response.id") == reply.id)
        assert root.service == "shop-api" and root.parent_span_id == ""
        assert root.resource["deployment.environment"] == "test"
        assert "engine.request" in {s.name for s in spans if s.trace_id == root.trace_id}
    finally:
        receiver.close()
