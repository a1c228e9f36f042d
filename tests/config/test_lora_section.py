"""The ``lora`` section: read from YAML, --set and the environment, checked with errors
that name the key, and shown by ``folio config``."""
import pytest

from config import ConfigError, load_config, parse_set_overrides
from config.lora import LoRAAdapterConfig, LoRAConfig
from config.loader import env_overrides


def write(tmp_path, text):
    path = tmp_path / "folio.yaml"
    path.write_text(text)
    return path


def test_the_default_is_off_with_vllms_limits():
    lora = load_config(use_env=False).lora
    assert lora == LoRAConfig()
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == \
        (False, 4, 16, 8)
    assert lora.adapters == () and lora.allowed_paths == ()
    assert lora.allow_runtime_updates is False


def test_yaml_adapters_and_runtime_updates(tmp_path):
    path = write(tmp_path, """
lora:
  enable_lora: true
  max_loras: 2
  max_cpu_loras: 3
  max_lora_rank: 32
  adapters:
    - {name: sql, path: /adapters/sql}
    - {name: poet, path: /adapters/poet}
  allow_runtime_updates: true
  allowed_paths: [/adapters]
""")
    lora = load_config(path, use_env=False).lora
    assert lora.adapters == (LoRAAdapterConfig("sql", "/adapters/sql"),
                             LoRAAdapterConfig("poet", "/adapters/poet"))
    assert (lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == (2, 3, 32)
    assert lora.allow_runtime_updates and lora.allowed_paths == ("/adapters",)


def test_set_env_and_vllms_flat_names(tmp_path):
    path = write(tmp_path, "")
    sets = parse_set_overrides(["lora.adapters=[sql=/a/sql, poet=/a/poet]",
                                "lora.enable_lora=true"])
    lora = load_config(path, sets, use_env=False).lora
    assert [(a.name, a.path) for a in lora.adapters] == [("sql", "/a/sql"), ("poet", "/a/poet")]
    env = env_overrides({"FOLIO_LORA__MAX_LORAS": "3", "FOLIO_LORA__MAX_CPU_LORAS": "5"})
    lora = load_config(path, env, use_env=False).lora
    assert (lora.max_loras, lora.max_cpu_loras) == (3, 5)
    flat = load_config(path, {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8,
                              "max_cpu_loras": 1}, use_env=False).lora
    assert (flat.enable_lora, flat.max_loras, flat.max_lora_rank, flat.max_cpu_loras) == \
        (True, 1, 8, 1)


@pytest.mark.parametrize("text,key,words", [
    ("lora:\n  max_loras: 0\n", "lora.max_loras", "1..256"),
    ("lora:\n  max_lora_rank: 1024\n", "lora.max_lora_rank", "1..512"),
    ("lora:\n  max_loras: 4\n  max_cpu_loras: 2\n", "lora.max_cpu_loras", "at least"),
    ("lora:\n  adapters: [{name: a}]\n", "lora.adapters", "needs a path"),
    ("lora:\n  adapters: [{name: '', path: /x}]\n", "lora.adapters", "name"),
    ("lora:\n  adapters: [{name: a, path: /x}, {name: a, path: /y}]\n", "lora.adapters",
     "must differ"),
    ("lora:\n  adapters: [{name: a, path: /x, rank: 8}]\n", "lora.adapters", "name, path"),
    ("lora:\n  adapters: [7]\n", "lora.adapters", "mapping"),
    ("lora:\n  max_lora: 2\n", "lora.max_lora", ""),
    ("lora:\n  allowed_paths: {a: 1}\n", "lora.allowed_paths", "expected a list"),
], ids=["max-loras-0", "rank-too-high", "cpu-below-slots", "no-path", "empty-name",
        "duplicate-names", "unknown-adapter-key", "adapter-not-mapping", "unknown-key",
        "paths-not-a-list"])
def test_bad_lora_values_name_the_key_and_file(tmp_path, text, key, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path, use_env=False)
    assert e.value.key == key, str(e.value)
    assert words in str(e.value) and str(path) in str(e.value)


def test_folio_config_shows_every_lora_key(capsys):
    from folio.cli import main
    assert main(["config", "--set", "lora.max_loras=3"]) == 0
    out = capsys.readouterr().out
    for key in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "adapters",
                "allow_runtime_updates", "allowed_paths"):
        assert f"{key}:" in out, key
    assert "device slots" in out and "allowed_paths" in out
