"""The import rules of pyproject.toml's [tool.importlinter] hold, and they can fail.

The second test copies the packages into a temporary folder, adds one forbidden import
and runs the same contracts there: each must then be reported broken.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("folio", "services", "worker", "kernels", "observability", "text",
            "engine_core", "model_files", "config")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))  # the copies shadow the installed tree
    only = [arg for c in contracts for arg in ("--contract", c)]
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *only], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, copy / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    return copy


@pytest.mark.parametrize("module,line,contract", [
    ("worker/sampler.py", "import services.api.app", "worker-no-services"),
    ("engine_core/request.py", "import torch", "engine-core-pure"),
    ("engine_core/scheduler.py", "import aiohttp", "engine-core-pure"),
    ("text/detokenizer.py", "import torch", "text-pure"),
    ("services/engine_core_service/service.py", "import services.api.generation",
     "services-by-process"),
    ("folio/llm.py", "import services.api.app", "api-process-only"),
    ("observability/metrics.py", "import services.api.auth", "api-process-only"),
    ("text/tokenizer.py", "import worker.sampler", "layers"),
    ("config/loader.py", "import engine_core.request", "layers"),
])
def test_a_forbidden_import_breaks_its_contract(tree_copy, module, line, contract):
    assert _lint(tree_copy, contract).returncode == 0  # the copy starts clean
    path = tree_copy / module
    original = path.read_text()
    path.write_text(original + f"\n{line}  # added by the test\n")
    try:
        result = _lint(tree_copy, contract)
    finally:
        path.write_text(original)
    assert result.returncode != 0 and "1 broken" in result.stdout, result.stdout
