"""Spec-decode counters: the engine's /metrics exposes vLLM's four, `folio bench serve`
turns them into the run's acceptance rate (Folio's names or vLLM's)."""
from engine_core.engine import EngineCoreStats
from engine_core.scheduler_output import SchedulerOutput
from engine_core.spec.speculator import SpecDecodeStats
from folio.bench.spec_metrics import acceptance_report, parse_spec_counters
from folio.bench.serve import format_report
from observability.metrics import EngineMetrics


def stats(spec):
    return EngineCoreStats(num_running=0, num_waiting=0, num_waiting_tokens=0,
                           num_preemptions=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                           prefix_cache_hits=0, spec_decode=spec)


def test_engine_metrics_expose_spec_counters_and_the_bench_reads_them():
    metrics = EngineMetrics("m", num_spec_positions=3)
    metrics.on_step(SchedulerOutput(), [], stats(SpecDecodeStats(1, 3, 2, [1, 1, 0])))
    before = parse_spec_counters(metrics.render())
    assert before == {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 2,
                      "num_accepted_tokens_per_pos": [1, 1, 0]}
    metrics.on_step(SchedulerOutput(), [], stats(SpecDecodeStats(5, 13, 9, [5, 3, 1])))
    report = acceptance_report(before, parse_spec_counters(metrics.render()))
    assert report == {"num_drafts": 4, "num_draft_tokens": 10, "num_accepted_tokens": 7,
                      "acceptance_rate": 0.7, "mean_acceptance_length": 2.75,
                      "accepted_per_position": [4, 2, 1]}
    assert parse_spec_counters(EngineMetrics("m").render()) is None  # speculation off


def test_vllm_counter_names_and_the_report_line():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{model_name="x"} 10',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        'vllm:spec_decode_num_draft_tokens_total{model_name="x"} 40',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        'vllm:spec_decode_num_accepted_tokens_total{model_name="x"} 30',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="1"} 12',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="0"} 18',
        ""])
    report = acceptance_report(None, parse_spec_counters(text))
    assert report["acceptance_rate"] == 0.75 and report["accepted_per_position"] == [18, 12]
    summary = {"completed": 1, "failed": 0, "duration_s": 1.0, "request_throughput": 1.0,
               "input_throughput": 1.0, "output_throughput": 1.0, "errors": {},
               "spec_decode": report,
               **{k: {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
                  for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}}
    assert "acceptance rate 75.0% (30 of 40 draft tokens), mean acceptance length 4.00" \
        in format_report(summary)
