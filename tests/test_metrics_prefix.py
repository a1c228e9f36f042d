"""Issue 18: ``observability.metrics_prefix`` renames the engine's metrics (``vllm``
for dashboards built for vLLM); the default stays ``folio``."""
import pytest

from config.loader import load_config
from observability.metrics import EngineMetrics


def test_metrics_prefix_switches_every_engine_metric_name():
    vllm = EngineMetrics("m", prefix="vllm").render()
    folio = EngineMetrics("m").render()
    assert "vllm:num_requests_running" in vllm and "vllm:request_success" in vllm
    assert "folio:" not in vllm
    assert "folio:num_requests_running" in folio and "vllm:" not in folio


def test_metrics_prefix_comes_from_the_yaml_and_is_checked():
    assert load_config(None, {"observability.metrics_prefix": "vllm"}
                       ).observability.metrics_prefix == "vllm"
    assert load_config(None, {}).observability.metrics_prefix == "folio"
    with pytest.raises(Exception, match="metrics_prefix"):
        load_config(None, {"observability.metrics_prefix": "bad prefix:"})
