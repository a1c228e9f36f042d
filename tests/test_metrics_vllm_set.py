"""Issue 18: vLLM's metrics that dashboards and autoscalers read, with vLLM's meanings:
``cache_config_info``, ``request_params_n``, ``request_params_max_tokens``,
``request_inference_time_seconds`` and ``iteration_tokens_total`` (per step with output:
first-token requests' prompt tokens plus generated tokens; vLLM's test expects
prompt + max_tokens per request, one more than the tokens the model computes).
A real EngineCore (fake executor) feeds EngineMetrics the way the engine-core service
does, step by step."""
import time

from prometheus_client.parser import text_string_to_metric_families

from config.schema import FolioConfig
from engine_core.model_facts import ModelFacts
from engine_core.sampling_params import SamplingParams
from observability.metrics import EngineMetrics
from services.engine_core_service.engine_observer import cache_config_info
from tests.engine_core.factories import make_engine

PROMPT, MAX_TOKENS = 12, 7


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "le")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels}


def _run(metrics: EngineMetrics, requests) -> None:
    """``requests``: (req_id, prompt ids, params), added at once, then stepped to the end."""
    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64,
                         enable_prefix_caching=False)
    for req_id, prompt, params in requests:
        sample_ids = engine.add_request(req_id, prompt, params)
        metrics.on_request(len(sample_ids), params.max_tokens)
        for sample_id in sample_ids:
            metrics.on_add(sample_id, time.time(), len(prompt))
    while engine.has_unfinished_requests():
        so = engine.begin_step()
        outputs = engine.end_step(so, engine.executor.execute_model(so))
        metrics.on_step(so, outputs, engine.get_stats())


def test_iteration_tokens_count_prompt_plus_max_tokens_per_request_as_vllm():
    metrics = EngineMetrics("m", prefix="vllm")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    # one at a time, as vLLM's test sends them: each step serves one request
    for i in range(3):
        _run(metrics, [(f"r{i}", list(range(1, PROMPT + 1)), params)])
    got = _samples(metrics.render())
    assert got[("vllm:iteration_tokens_total_sum", ())] == 3 * (PROMPT + MAX_TOKENS)
    assert got[("vllm:iteration_tokens_total_count", ())] == 3 * MAX_TOKENS
    # what the model computed: the last sampled token is never fed back
    assert got[("vllm:iteration_scheduled_tokens_sum", ())] == 3 * (PROMPT + MAX_TOKENS - 1)
    assert got[("vllm:generation_tokens_total", ())] == 3 * MAX_TOKENS
    assert got[("vllm:request_params_max_tokens_sum", ())] == 3 * MAX_TOKENS
    assert got[("vllm:request_params_max_tokens_count", ())] == 3
    assert got[("vllm:request_params_n_count", ())] == 3
    assert got[("vllm:request_inference_time_seconds_count", ())] == 3
    assert got[("vllm:request_inference_time_seconds_sum", ())] >= 0


def test_request_params_n_is_one_observation_per_request():
    metrics = EngineMetrics("m")
    _run(metrics, [("a", [1, 2, 3], SamplingParams(max_tokens=2, n=3, ignore_eos=True)),
                   ("b", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True))])
    got = _samples(metrics.render())
    assert got[("folio:request_params_n_count", ())] == 2
    assert got[("folio:request_params_n_sum", ())] == 4
    assert got[("folio:request_params_max_tokens_sum", ())] == 7
    # every sample ran: 3 of "a" and 1 of "b"
    assert got[("folio:request_inference_time_seconds_count", ())] == 4
    # all samples of a step together: 3 x 3 + 2 prompt tokens + 4 first tokens in the
    # first step, then 1 per live sample per step; 3 x 2 + 5 generated in all
    assert got[("folio:iteration_tokens_total_sum", ())] == 3 * 3 + 2 + 3 * 2 + 5


def test_cache_config_info_is_one_series_of_value_1_labelled_by_the_config():
    config = FolioConfig()
    facts = ModelFacts(num_blocks=321, block_size=16, max_model_len=2048, vocab_size=49152,
                       eos_token_ids=[2], dtype="float32", device="cpu")
    info = cache_config_info(config, facts)
    text = EngineMetrics("m", prefix="vllm", cache_info=info).render()
    series = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "vllm:cache_config_info"]
    assert len(series) == 1 and series[0].value == 1
    labels = series[0].labels
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "321"
    assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "float32"
    assert labels["prefix_caching_hash_algo"] == config.cache.hash_algorithm
    assert "cache_config_info" not in EngineMetrics("m").render()  # no facts, no series
