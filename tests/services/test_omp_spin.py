"""The worker's GOMP_SPINCOUNT: from the YAML, before torch loads libgomp."""
import subprocess
import sys
from pathlib import Path

from services.worker_service.omp_spin import apply_from_argv, spin_count_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_configured_count_is_set_unless_the_environment_says_otherwise():
    env = {}
    assert apply_from_argv(["--config", str(ROOT / "config/default.yaml")], env)
    assert env == {"GOMP_SPINCOUNT": "3000"}
    env = {}
    assert apply_from_argv(["--set", "worker.omp_spin_count=50", "--rank", "1"], env)
    assert env == {"GOMP_SPINCOUNT": "50"}
    for user in ({"GOMP_SPINCOUNT": "7"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(user)
        assert not spin_count_env(3000, env) and env == user
    env = {}
    assert not apply_from_argv(["--set", "worker.omp_spin_count=null"], env) and env == {}
    assert not apply_from_argv(["--config", "/nonexistent.yaml"], env) and env == {}


def test_it_runs_before_torch_is_imported():
    # libgomp reads GOMP_SPINCOUNT once, when torch loads it: the worker's entry point
    # sets it first, so this module must not pull torch in
    code = ("import sys; import services.worker_service.omp_spin; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
    entry = (ROOT / "services/worker_service/__main__.py").read_text()
    assert entry.index("apply_from_argv(sys.argv[1:])") < entry.index(
        "from services.worker_service.service import")
