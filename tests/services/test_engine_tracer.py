"""The engine core's spans in both trace_step_detail modes, on the real engine and the
tiny model in-process, recorded by the OpenTelemetry SDK's in-memory exporter."""
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine_core.outputs import ModelRunnerOutput
from engine_core.sampling_params import SamplingParams
from observability.tracing import traceparent_of
from services.engine_core_service.engine_tracer import EngineTracer

MAX_TOKENS = 12


def run_traced(llm, detail, prompts, record_drafts=False):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    engine_tracer = EngineTracer(tracer, detail, record_drafts)
    root = tracer.start_span("root")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        engine_tracer.on_add(f"r{i}", traceparent_of(root), len(prompt))
    while engine.has_unfinished_requests():
        so = engine.begin_step()
        engine_tracer.begin_step(so)
        runner_output = (llm.runner.execute_model(so) if engine.needs_worker(so)
                         else ModelRunnerOutput())
        engine_tracer.end_step(so, engine.end_step(so, runner_output),
                               engine.last_draft_outcomes())
    root.end()
    assert not engine_tracer.requests  # every request's spans were closed
    return exporter.get_finished_spans()


def children_of(spans, parent, name):
    return [s for s in spans if s.parent is not None
            and s.parent.span_id == parent.context.span_id and s.name == name]


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
@pytest.mark.parametrize("detail", ["step", "phase"])
def test_request_spans_per_step_or_per_phase(make_tiny_llm, detail, num_scheduler_steps):
    llm = make_tiny_llm(max_num_batched_tokens=32,  # a 70-token prompt takes 3 chunks
                        **{"scheduler.num_scheduler_steps": num_scheduler_steps})
    spans = run_traced(llm, detail, [list(range(100, 170)), [5, 6, 7]])
    requests = [s for s in spans if s.name == "engine.request"]
    assert len(requests) == 2
    long_req = next(s for s in requests if s.attributes["folio.request_id"] == "r0")
    prefill = children_of(spans, long_req, "engine.prefill")
    decode = children_of(spans, long_req, "engine.decode")
    # the first output token comes from the prompt's last step; the other 11 from decode
    # steps, one each or up to num_scheduler_steps per run
    decode_steps = [s for s in spans if s.name == "engine.step"  # after its 3 prefill steps
                    and any(link.context.span_id == long_req.context.span_id
                            for link in s.links)][3:]
    if detail == "step":
        assert len(prefill) == 3
        assert [s.attributes["folio.num_tokens"] for s in prefill] == [32, 32, 6]
        runs = [s.attributes["folio.num_tokens"] for s in decode]
        assert sum(runs) == MAX_TOKENS - 1 and len(decode) == len(decode_steps)
        assert [s.attributes["folio.num_decode_steps"] for s in decode_steps] == runs
        if num_scheduler_steps == 1:
            assert runs == [1] * (MAX_TOKENS - 1)
        else:  # runs of up to 4
            assert max(runs) == 4 and len(runs) < MAX_TOKENS - 1
    else:
        assert len(prefill) == 1 and len(decode) == 1
        assert prefill[0].attributes["folio.num_steps"] == 3
        assert prefill[0].attributes["folio.num_tokens"] == 70
        assert decode[0].attributes["folio.num_tokens"] == MAX_TOKENS - 1
        num_steps = decode[0].attributes["folio.num_steps"]
        assert len(decode[0].links) == num_steps == len(decode_steps)  # each step it ran in
        assert (num_steps == MAX_TOKENS - 1) == (num_scheduler_steps == 1)
    assert len(children_of(spans, long_req, "engine.queue")) == 1
    assert long_req.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    steps = {s.context.span_id: s for s in spans if s.name == "engine.step"}
    for span in prefill + decode:
        assert all(link.context.span_id in steps for link in span.links)


def test_preemption_events_and_a_second_queue_span(make_tiny_llm):
    llm = make_tiny_llm(num_blocks=6, max_model_len=64)  # 5 usable blocks of 16 tokens
    spans = run_traced(llm, "step", [list(range(100, 130)), list(range(200, 230))])
    assert llm.engine.num_preemptions > 0
    preempted = [s for s in spans if s.name == "engine.request"
                 and "preempted" in [e.name for e in s.events]]
    assert preempted
    for req in preempted:
        events = [e.name for e in req.events]
        assert events.index("preempted") < events.index("resumed")
        queues = children_of(spans, req, "engine.queue")
        assert len(queues) == 1 + events.count("preempted")


@pytest.mark.parametrize("detail", ["step", "phase"])
def test_decode_spans_carry_draft_tokens_proposed_and_accepted(make_tiny_llm,
                                                               tiny_llama_draft_dir, detail):
    llm = make_tiny_llm(speculative_method="draft_model", num_speculative_tokens=3,
                        speculative_draft_model=str(tiny_llama_draft_dir),
                        **{"speculative.enable_adaptive": False})
    spans = run_traced(llm, detail, [list(range(100, 120))], record_drafts=True)
    decode = [s for s in spans if s.name == "engine.decode"]
    proposed = [s.attributes["folio.spec.num_draft_tokens"] for s in decode]
    accepted = [s.attributes["folio.spec.num_accepted_tokens"] for s in decode]
    assert sum(proposed) == llm.engine.get_stats().spec_decode.num_draft_tokens > 0
    assert accepted == proposed  # the model drafting for itself
    if detail == "step":  # 11 tokens after the first: 3 + 1 per step, then 2 + 1
        assert proposed == [3, 3, 2] and len(decode) == 3
    assert all("folio.spec.num_draft_tokens" not in s.attributes
               for s in spans if s.name == "engine.prefill")
