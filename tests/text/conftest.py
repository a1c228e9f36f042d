"""Fixtures for tokenizer tests: Folio's SmolLM2 tokenizer and transformers' conversion.

transformers needs 10-20 s on two cores to convert the GGUF's vocabulary (its GGUF reader
is slow), so its result is saved with save_pretrained into pytest's cache, keyed by the
GGUF file and the transformers version; later runs reload it in under a second.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

# Never reach for a model hub, whatever a test imports.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from model_files.paths import default_model_path  # noqa: E402

_COMPLETE_MARKER = "folio-complete"


@pytest.fixture(scope="session")
def transformers_tokenizer_dir(request: pytest.FixtureRequest,
                               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' own GGUF → tokenizer conversion of the default model, saved to disk."""
    gguf = default_model_path()
    stat = gguf.stat()
    version = importlib.metadata.version("transformers")
    name = f"folio-transformers-tokenizer-{stat.st_size}-{stat.st_mtime_ns}-{version}"
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    folder = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    if not (folder / _COMPLETE_MARKER).is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
        (folder / _COMPLETE_MARKER).write_text("ok")
    return folder


@pytest.fixture(scope="session")
def transformers_tokenizer(transformers_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(transformers_tokenizer_dir)
