"""services/entrypoint.py: how a service process ends."""
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A service whose serve() returns by itself, as a tensor-parallel rank does when rank 0
# tells it to leave, and whose process then spends a while in native wind-down after
# the interpreter is finalized (gloo and torch's destructors do; libc's pause() stands
# in for them here).
_SERVICE = textwrap.dedent("""
    import atexit, ctypes, sys
    from services.entrypoint import run_service, service_arguments

    async def serve(config, args, stop):
        stop.mark_serving()
        return 0

    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(ctypes.cast(libc.pause, ctypes.c_void_p), None, None)  # after Py_Finalize
    atexit.register(lambda: print("winding down", flush=True))
    sys.exit(run_service("test", serve, service_arguments("test")))
""")


def test_a_finished_service_is_not_killed_by_a_late_sigterm_while_it_winds_down():
    proc = subprocess.Popen([sys.executable, "-c", _SERVICE], cwd=REPO,
                            stdout=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout.readline().strip() == "winding down"
        time.sleep(0.5)  # past the interpreter's own signal handlers
        proc.send_signal(signal.SIGTERM)  # the launcher stopping the stack just then
        time.sleep(0.5)
        assert proc.poll() is None, "killed by the late SIGTERM"
    finally:
        proc.kill()
        proc.wait(10)
