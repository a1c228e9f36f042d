"""The native kernels' build never waits on a builder that died (CI once hung for 90 min
on a torch ``lock`` file left by a build killed mid-compile)."""
import subprocess
import sys
import time

from kernels.cpu_extension import build_guard

_HOLDER = """
import fcntl, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
guard = open(folder / "folio.flock", "a+")
fcntl.flock(guard, fcntl.LOCK_EX)
(folder / "lock").touch()           # torch's baton, as a build in progress has it
print("held", flush=True)
time.sleep(float(sys.argv[2]))
(folder / "lock").unlink()          # a build that finishes removes its baton
"""


def _start_holder(folder, seconds):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_baton_left_by_a_dead_builder_is_removed(tmp_path):
    (tmp_path / "lock").touch()
    with build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_builder_killed_mid_build_does_not_block_the_next(tmp_path):
    holder = _start_holder(tmp_path, 600)
    holder.kill()  # SIGKILL: no cleanup runs, the baton stays
    holder.wait()
    assert (tmp_path / "lock").exists()
    t0 = time.monotonic()
    with build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - t0 < 5


def test_a_live_builder_is_waited_for_and_its_baton_left_alone(tmp_path):
    holder = _start_holder(tmp_path, 1.0)
    t0 = time.monotonic()
    with build_guard(tmp_path):
        waited = time.monotonic() - t0
    assert holder.wait(timeout=10) == 0  # its own unlink found the baton still there
    assert waited > 0.5
