"""LoRA in traces and logs: the adapter's name on the root span and on engine.request;
loads, evictions and load failures logged by the worker."""
import shutil
import threading

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import capture_logs

from engine_core.lora_registry import LoRALoad
from engine_core.sampling_params import SamplingParams
from observability.tracing import traceparent_of
from services.api.request_trace import RequestTrace
from services.engine_core_service.engine_tracer import EngineTracer


def test_root_span_and_engine_request_carry_the_adapter_name():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    trace = RequestTrace(tracer, "chat", "sql-adapter", "chatcmpl-1", None,
                         SamplingParams(max_tokens=4), lora_name="sql-adapter")
    engine = EngineTracer(tracer)
    engine.on_add("chatcmpl-1", trace.traceparent, 3, "sql-adapter")
    engine.requests["chatcmpl-1"].queue_span.end()
    engine.requests["chatcmpl-1"].span.end()
    trace.finish()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, request = spans["chat sql-adapter"], spans["engine.request"]
    assert root.attributes["folio.lora_adapter"] == "sql-adapter"
    assert root.attributes["gen_ai.request.model"] == "sql-adapter"
    assert request.attributes["folio.lora_adapter"] == "sql-adapter"
    assert request.parent.span_id == root.context.span_id
    plain = RequestTrace(tracer, "chat", "base", "chatcmpl-2", None, SamplingParams())
    plain.finish()
    assert "folio.lora_adapter" not in exporter.get_finished_spans()[-1].attributes
    assert traceparent_of  # the helpers the engine tracer links with stay importable


def test_loads_evictions_and_failures_are_logged(make_tiny_llm, tiny_lora_adapters, tmp_path):
    llm = make_tiny_llm(enable_lora=True, **{"observability.log_level": "info"})
    manager = llm.runner.lora
    done = threading.Event()
    broken = shutil.copytree(tiny_lora_adapters["qv8"], tmp_path / "broken")
    (broken / "adapter_model.safetensors").unlink()
    with capture_logs() as logs:
        manager.start_load(LoRALoad(7, "qv8", str(tiny_lora_adapters["qv8"])), lambda r: None)
        manager.start_load(LoRALoad(8, "broken", str(broken)), lambda r: done.set())
        assert done.wait(30)
        manager.evict(7)
    events = {e["event"]: e for e in logs}
    assert events["lora adapter loaded"]["lora_name"] == "qv8"
    assert events["lora adapter loaded"]["rank"] == 8
    assert "no adapter_model.safetensors" in events["lora adapter load failed"]["error"]
    assert events["lora adapter evicted"]["lora_id"] == 7
    assert str(tmp_path) not in str(logs)  # no paths in the lines
