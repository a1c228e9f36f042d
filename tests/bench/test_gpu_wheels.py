"""The GPU check's wheel folder travels with the tree under the device tool's 64 MiB,
and every wheel installs on the GPU machine (CPython 3.12, x86-64 Linux)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from wheel_folder import LIMIT_BYTES, check, tree_files, wheel_tag_ok  # noqa: E402


def test_the_built_folder_fits_and_installs_there(gpu_wheel_folder):
    result = check(gpu_wheel_folder)
    assert result["ok"], result
    names = {row["wheel"].split("-")[0] for row in result["wheels"]}
    assert names == {"structlog", "gguf"}
    assert all(row["tag_ok"] for row in result["wheels"])
    assert result["folder_bytes"] < 4 * 2 ** 20  # a few MiB at most: no model travels
    assert result["total_bytes"] == result["folder_bytes"] + result["tree_bytes"]
    assert result["total_bytes"] < LIMIT_BYTES


@pytest.mark.parametrize("name, ok", [
    ("structlog-26.1.0-py3-none-any.whl", True),
    ("six-1.17.0-py2.py3-none-any.whl", True),
    ("numpy-2.3.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
    ("cryptography-45.0.0-cp39-abi3-manylinux_2_28_x86_64.whl", True),
    ("ninja-1.13.0-py3-none-manylinux_2_12_x86_64.manylinux2010_x86_64.whl", True),
    ("numpy-2.3.0-cp311-cp311-manylinux_2_17_x86_64.whl", False),  # another Python
    ("numpy-2.3.0-cp312-cp312-macosx_14_0_arm64.whl", False),
    ("numpy-2.3.0-cp312-cp312-manylinux_2_17_aarch64.whl", False),  # another CPU
    ("numpy-2.3.0-cp312-cp312-win_amd64.whl", False),
    ("gguf-0.19.0.tar.gz", False),  # an sdist would need building there
])
def test_wheel_tags(name, ok):
    assert wheel_tag_ok(name) is ok


def test_the_check_fails_on_a_wrong_tag_or_too_many_bytes(tmp_path):
    (tmp_path / "ok-1.0-py3-none-any.whl").write_bytes(b"x")
    assert check(tmp_path)["ok"]
    (tmp_path / "bad-1.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"x")
    assert not check(tmp_path)["ok"]
    (tmp_path / "bad-1.0-cp311-cp311-manylinux_2_17_x86_64.whl").unlink()
    with open(tmp_path / "big-1.0-py3-none-any.whl", "wb") as f:  # sparse: no disk used
        f.truncate(LIMIT_BYTES)
    result = check(tmp_path)
    assert not result["ok"] and result["total_bytes"] > LIMIT_BYTES
    assert not check(tmp_path / "empty-folder-does-not-exist")["ok"]


def test_the_default_folder_is_ignored_so_it_travels_only_when_carried():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu_wheels/x.whl"], cwd=ROOT)
    assert ignored.returncode == 0
    assert not any(".gpu_wheels" in f.parts for f in tree_files(ROOT))
    readme = (ROOT / "README.md").read_text()
    assert 'carry=[".gpu_wheels"]' in readme and "benchmarks/gpu_check.sh" in readme
