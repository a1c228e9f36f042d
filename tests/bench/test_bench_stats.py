"""The serving report's arithmetic and the synthetic workloads."""
import pytest

from folio.bench.stats import RequestRecord, meets, percentile, summarize
from folio.bench.workload import make_workload


def test_percentile_matches_linear_interpolation():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile([], 50) == 0.0


def test_summary_throughput_latency_and_goodput():
    fast = RequestRecord(prompt_len=10, success=True, output_len=5, ttft=0.1, e2e=0.5,
                         itl=[0.1] * 4)
    slow = RequestRecord(prompt_len=30, success=True, output_len=11, ttft=1.0, e2e=3.0,
                         itl=[0.2] * 10)
    failed = RequestRecord(prompt_len=7, error="HTTP 503: busy")
    report = summarize([fast, slow, failed], duration=2.0,
                       slo_ms={"ttft": 500, "tpot": 150})
    assert (report["completed"], report["failed"]) == (2, 1)
    assert report["request_throughput"] == 1.0
    assert report["input_throughput"] == 20.0 and report["output_throughput"] == 8.0
    assert report["ttft_ms"]["mean"] == pytest.approx(550.0)
    assert fast.tpot == pytest.approx(0.1) and slow.tpot == pytest.approx(0.2)
    assert report["tpot_ms"]["p50"] == pytest.approx(150.0)
    assert report["itl_ms"]["mean"] == pytest.approx((0.4 + 2.0) / 14 * 1000)
    assert report["goodput"]["requests_meeting_slo"] == 1  # slow misses TTFT, failed fails
    assert report["goodput"]["request_goodput"] == 0.5
    assert meets(fast, {"e2e": 500}) and not meets(fast, {"e2e": 499})
    assert report["errors"] == ["HTTP 503: busy"]


@pytest.mark.parametrize("dataset", ["fixed", "uniform", "chat", "shared-prefix"])
def test_workloads_have_the_requested_shape(smollm_tokenizer, dataset):
    reqs = make_workload(smollm_tokenizer, dataset, 40, input_len=64, output_len=32,
                         range_ratio=0.5, prefix_len=200, seed=1)
    assert len(reqs) == 40
    assert reqs == make_workload(smollm_tokenizer, dataset, 40, 64, 32, 0.5, 200, seed=1)
    outs = [r.output_len for r in reqs]
    ins = [r.prompt_len for r in reqs]
    if dataset == "fixed":
        assert set(outs) == {32}
    if dataset == "uniform":
        assert min(outs) >= 16 and max(outs) <= 48 and len(set(outs)) > 5
    if dataset == "chat":  # long tail: the longest far above the median
        assert max(outs) > 2.5 * sorted(outs)[20]
    if dataset == "shared-prefix":
        prefix = reqs[0].prompt[:300]
        assert all(r.prompt.startswith(prefix) for r in reqs) and min(ins) > 200
    for r in reqs:  # the recorded length is the prompt's real token count
        assert r.prompt_len == len(smollm_tokenizer.encode(r.prompt))


def test_bench_throughput_command(tiny_llama_dir, default_model_path, tmp_path):
    import json

    from folio.cli import main
    out = tmp_path / "throughput.json"
    settings = {"model.path": tiny_llama_dir, "model.tokenizer": default_model_path,
                "model.dtype": "float32", "model.max_model_len": 256,
                "memory.num_blocks": 128, "observability.log_level": "warning"}
    argv = ["bench", "throughput"]
    for key, value in settings.items():
        argv += ["--set", f"{key}={value}"]
    assert main(argv + ["--dataset", "fixed", "--num-prompts", "4", "--input-len", "16",
                        "--output-len", "8", "--result-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_requests"] == 4 and report["total_output_tokens"] == 32
    assert report["output_throughput"] > 0
