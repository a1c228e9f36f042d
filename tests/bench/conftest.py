"""The GPU check's wheel folder, built once per session from the package index."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _index_reachable() -> bool:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    host = urlparse(url).hostname or "pypi.org"
    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def gpu_wheel_folder(tmp_path_factory) -> Path:
    """benchmarks/gpu_wheels.sh's folder, as the GPU check would carry it."""
    folder = tmp_path_factory.mktemp("gpu_wheels")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_wheels.sh"), str(folder)],
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        if not _index_reachable():
            pytest.skip("the package index cannot be reached, and the GPU check's wheel "
                        "folder is built from it (benchmarks/gpu_wheels.sh)")
        pytest.fail(f"benchmarks/gpu_wheels.sh failed:\n{proc.stdout[-2000:]}"
                    f"{proc.stderr[-2000:]}")
    return folder
