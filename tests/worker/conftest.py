"""Fixtures for the loader tests: the default model loaded once, and transformers' view of it.

transformers needs about 40 s on two cores to load the default GGUF (its GGUF reader is
slow), so its state dict is reduced to one sha256 per tensor and kept in pytest's cache,
keyed by the GGUF file and the transformers/gguf versions. A digest mismatch reloads the
full reference and compares with allclose, so a cached run is exactly as strict.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

# Never reach for a model hub, whatever a test imports.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from worker.loader import LoadedModel, load_model  # noqa: E402
from model_files.paths import default_model_path  # noqa: E402


@pytest.fixture(scope="session")
def _kernel_build_root() -> Path:
    """Where the native CPU kernels build outside these tests (before any test points
    FOLIO_CACHE_DIR elsewhere): one build shared by every test and every process."""
    from kernels import cpu_extension
    root = cpu_extension.build_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(autouse=True)
def _private_weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          _kernel_build_root: Path) -> Path:
    """Each test gets an empty weight cache, never the user's ~/.cache/folio.

    The kernels' build folder inside it links to the shared one: an empty one would
    make every process a test starts (ranks, services) compile the extension again,
    about 40 s each on two cores, and no test here is about that build."""
    cache_dir = tmp_path / "folio-cache"
    cache_dir.mkdir()
    (cache_dir / "torch_extensions").symlink_to(_kernel_build_root, target_is_directory=True)
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(cache_dir))
    return cache_dir


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2 loaded by Folio in float32, without the disk cache."""
    return load_model("default", torch.float32, use_cache=False)


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def load_transformers_gguf_state_dict(gguf_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading (its dequantisation and un-permutation), float32.

    The tied lm_head is dropped: it is the embedding matrix itself there.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    assert model.config.tie_word_embeddings
    return {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"}


@pytest.fixture(scope="session")
def transformers_gguf_digests(request: pytest.FixtureRequest,
                              default_gguf_path: Path) -> dict[str, dict]:
    """name → {"shape", "sha256"} of transformers' state dict for the default GGUF."""
    stat = default_gguf_path.stat()
    versions = "-".join(importlib.metadata.version(p) for p in ("transformers", "gguf"))
    key = f"folio/transformers-gguf-digests/{stat.st_size}-{stat.st_mtime_ns}-{versions}"
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    cached = cache.get(key, None) if cache is not None else None
    if cached:
        return cached
    state_dict = load_transformers_gguf_state_dict(default_gguf_path)
    digests = {name: {"shape": list(t.shape), "sha256": tensor_digest(t)}
               for name, t in state_dict.items()}
    if cache is not None:
        cache.set(key, digests)
    return digests
