"""The decode kernel's V pass, chosen by measurement (worker/decode_v_pass.py)."""
import os

import pytest

from kernels import cpu_paged_attention as cpa
from worker import decode_v_pass, linear_backend
from worker.decode_v_pass import choose_decode_v_pass, faster, table_key

if os.environ.get(cpa.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpa.DISABLE_ENV} is set", allow_module_level=True)


def test_paired_must_win_by_the_margin():
    assert faster({"widened": 1.0}) == "widened"
    assert faster({"widened": 1.0, "paired": 0.9}) == "paired"
    assert faster({"widened": 1.0, "paired": 0.97}) == "widened"  # within the margin
    assert faster({"widened": 1.0, "paired": 1.2}) == "widened"


@pytest.fixture(autouse=True)
def _extension_loaded():
    """Loaded before a test points FOLIO_CACHE_DIR elsewhere (which would rebuild it)."""
    cpa.decode_v_passes()


def test_measured_once_then_taken_from_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_backend, "machine_is_busy", lambda: False)
    monkeypatch.setattr(decode_v_pass, "machine_is_busy", lambda: False)
    measured = []
    real = decode_v_pass.measure
    monkeypatch.setattr(decode_v_pass, "measure", lambda *a: measured.append(a) or real(*a))
    choice = choose_decode_v_pass("auto", 9, 3, 64)
    assert choice in cpa.decode_v_passes()
    if len(cpa.decode_v_passes()) == 1:
        assert not measured  # nothing to choose from
        return
    assert measured == [(9, 3, 64)]
    path = linear_backend.table_path()
    assert linear_backend.read_table(path)[table_key(9, 3, 64)] == choice
    assert choose_decode_v_pass("auto", 9, 3, 64) == choice and len(measured) == 1  # cached
    # the linear table's own entries and this one live side by side in the file
    linear_backend.write_table(path, {**linear_backend.read_table(path), "q4_1:8:32": ["x"]})
    assert choose_decode_v_pass("auto", 9, 3, 64) == choice and len(measured) == 1


def test_deterministic_mode_and_a_busy_machine_keep_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))
    path = linear_backend.table_path()
    monkeypatch.setattr(linear_backend, "machine_is_busy", lambda: False)
    linear_backend.write_table(path, {table_key(9, 3, 64): "paired"})
    if "paired" in cpa.decode_v_passes():
        assert choose_decode_v_pass("auto", 9, 3, 64) == "paired"  # the cached choice
    # deterministic mode never takes the paired pass, cached or not: two starts could
    # choose differently, and the passes round differently
    assert choose_decode_v_pass("auto", 9, 3, 64, deterministic=True) == "widened"
    monkeypatch.setattr(decode_v_pass, "machine_is_busy", lambda: True)
    assert choose_decode_v_pass("auto", 9, 6, 64) == "widened"  # not cached, too busy to time
    assert table_key(9, 6, 64) not in linear_backend.read_table(path)


def test_a_configured_pass_is_taken_where_built(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(decode_v_pass, "measure", lambda *a: pytest.fail("no timing asked"))
    assert choose_decode_v_pass("widened", 9, 3, 64) == "widened"
    paired = "paired" if "paired" in cpa.decode_v_passes() else "widened"
    assert choose_decode_v_pass("paired", 9, 3, 64) == paired
    assert choose_decode_v_pass("paired", 9, 3, 64, deterministic=True) == paired
    assert choose_decode_v_pass("paired", 4, 2, 16) == "widened"  # head_dim 16 widens


def test_the_config_key_is_checked_and_reaches_the_backend(tmp_path, monkeypatch):
    from config.fields import ConfigError
    from config.schema import WorkerConfig
    with pytest.raises(ConfigError, match="worker.decode_v_pass"):
        WorkerConfig(decode_v_pass="fast")
    from folio import LLM
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))
    for configured, dtype in (("paired", "bfloat16"), ("widened", "bfloat16"),
                              ("paired", "float32")):
        llm = LLM(model="default", dtype=dtype, max_model_len=128, num_blocks=16,
                  **{"worker.decode_v_pass": configured, "observability.log_level": "warning"})
        want = ("paired" if configured == "paired" and dtype == "bfloat16"
                and "paired" in cpa.decode_v_passes() else "widened")
        assert llm.runner.attention_backend.decode_v_pass == want
        del llm
