"""worker.deterministic: off by default, and refused at load time, naming both keys,
beside the features that have no batch-invariant path."""
import pytest

from config import ConfigError, load_config
from config.deterministic import deterministic_conflicts


def test_off_by_default_and_on_alone_is_accepted():
    assert load_config(None).worker.deterministic is False
    config = load_config(None, {"worker.deterministic": True})
    assert config.worker.deterministic and deterministic_conflicts(config) == []


@pytest.mark.parametrize("key,value", [
    ("lora.enable_lora", True),
    ("speculative.method", "ngram"),
    ("parallel.tensor_parallel_size", 2),
    ("worker.device", "cuda"),
    ("worker.attention_backend", "torch"),
    ("model.quantization", "auto"),
    ("memory.kv_cache_dtype", "int8"),
])
def test_refused_with_each_unsupported_feature(key, value):
    overrides = {key: value}
    if key == "speculative.method":
        overrides["speculative.num_speculative_tokens"] = 2
    load_config(None, overrides)  # fine on its own
    with pytest.raises(ConfigError) as err:
        load_config(None, {**overrides, "worker.deterministic": True})
    assert err.value.key == key
    assert "worker.deterministic" in str(err.value) and key in str(err.value)

