"""Config loading: defaults, overrides, and errors that name the key and the file."""
import pytest

from config import ConfigError, load_config, parse_set_overrides
from config.loader import DEFAULT_CONFIG_PATH, env_overrides


def write(tmp_path, text):
    path = tmp_path / "folio.yaml"
    path.write_text(text)
    return path


def test_default_file_loads_and_each_section_is_typed():
    c = load_config(use_env=False)
    assert c.model.path == "default"
    assert c.scheduler.policy == "fcfs" and c.memory.block_size == 16
    assert c.cache.enable_prefix_caching is True
    assert c.speculative.method == "none" and c.speculative.enable_adaptive is True
    spec = load_config(overrides={"speculative_method": "ngram", "num_speculative_tokens": 3},
                       use_env=False).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.is_enabled) == ("ngram", 3, True)


def test_set_env_and_keyword_overrides_in_order(tmp_path):
    path = write(tmp_path, "scheduler:\n  max_num_seqs: 8\n")
    assert load_config(path, use_env=False).scheduler.max_num_seqs == 8
    sets = parse_set_overrides(["scheduler.max_num_seqs=64", "model.max_model_len=null"])
    c = load_config(path, sets, use_env=False)
    assert c.scheduler.max_num_seqs == 64 and c.model.max_model_len is None
    env = env_overrides({"FOLIO_SCHEDULER__MAX_NUM_SEQS": "32", "OTHER": "1"})
    assert env == {"scheduler.max_num_seqs": 32}
    c = load_config(path, {"max_num_seqs": 4, "dtype": "float32"}, use_env=False)
    assert c.scheduler.max_num_seqs == 4 and c.model.dtype == "float32"


def test_environment_is_read(monkeypatch, tmp_path):
    monkeypatch.setenv("FOLIO_CACHE__ENABLE_PREFIX_CACHING", "false")
    assert load_config(write(tmp_path, "")).cache.enable_prefix_caching is False


@pytest.mark.parametrize("text,key", [
    ("scheduler:\n  max_num_seq: 8\n", "scheduler.max_num_seq"),
    ("schedular:\n  max_num_seqs: 8\n", "schedular"),
    ("scheduler:\n  max_num_seqs: many\n", "scheduler.max_num_seqs"),
    ("scheduler:\n  max_num_seqs: 0\n", "scheduler.max_num_seqs"),
    ("scheduler:\n  policy: lifo\n", "scheduler.policy"),
    ("memory:\n  block_size: 12\n", "memory.block_size"),
    ("cache:\n  enable_prefix_caching: maybe\n", "cache.enable_prefix_caching"),
    ("model:\n  dtype: int4\n", "model.dtype"),
    ("speculative:\n  method: medusa\n", "speculative.method"),
    ("speculative:\n  num_speculative_tokens: 0\n", "speculative.num_speculative_tokens"),
    ("speculative:\n  prompt_lookup_min: 4\n  prompt_lookup_max: 3\n",
     "speculative.prompt_lookup_max"),
    ("speculative:\n  method: draft_model\n", "speculative.draft_model"),
    ("speculative:\n  disable_by_batch_size: 0\n", "speculative.disable_by_batch_size"),
    ("parallel:\n  data_parallel_size: 0\n", "parallel.data_parallel_size"),
    ("parallel:\n  routing: random\n", "parallel.routing"),
    ("parallel:\n  routing_max_imbalance: -1\n", "parallel.routing_max_imbalance"),
    ("parallel:\n  data_parallel_size: 2\n  tensor_parallel_size: 2\n",
     "parallel.data_parallel_size"),
    ("parallel:\n  data_parallel_size: 2\nservices:\n  worker_address: 'w:9000'\n",
     "services.worker_address"),
    ("api:\n  tenant_body_max_wait_s: -1\n", "api.tenant_body_max_wait_s"),
    ("api:\n  public_poll_interval_s: -1\n", "api.public_poll_interval_s"),
    ("scheduler:\n  fair_step_factor: 0.5\n", "scheduler.fair_step_factor"),
    ("scheduler:\n  fair_step_factor: -2\n", "scheduler.fair_step_factor"),
    ("worker:\n  omp_spin_count: -1\n", "worker.omp_spin_count"),
    ("worker:\n  omp_spin_count: lots\n", "worker.omp_spin_count"),
])
def test_bad_keys_and_values_name_key_and_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path, use_env=False)
    assert e.value.key == key
    assert key in str(e.value) and str(path) in str(e.value)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [unclosed\n"), use_env=False)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", use_env=False)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_set_overrides(["scheduler.max_num_seqs"])


def test_unknown_override_key_names_its_source():
    with pytest.raises(ConfigError, match=r"scheduler\.bogus.*overrides"):
        load_config(DEFAULT_CONFIG_PATH, {"scheduler.bogus": 1}, use_env=False)


def test_the_offline_llm_runs_one_replica():
    from folio import LLM
    with pytest.raises(ConfigError, match="data_parallel_size") as e:
        LLM(data_parallel_size=2)  # refused before any model loads
    assert e.value.key == "parallel.data_parallel_size"
