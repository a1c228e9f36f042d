"""Run `folio serve` as a real process for end-to-end tests, and look at its children."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from observability.process_stats import command_line, descendants, is_running

REPO = Path(__file__).resolve().parents[2]
_READY = re.compile(r"API listening on (http://\S+)")


def write_config(path: Path, model_path: str, tokenizer_path: str | None = None,
                 **sections) -> Path:
    """A YAML config for a test stack; ``sections`` are merged over the tiny defaults."""
    tree = {
        "model": {"path": model_path, "tokenizer": tokenizer_path, "dtype": "float32",
                  "max_model_len": 1024, "served_model_name": "folio-tiny"},
        "memory": {"num_blocks": 512},
        "observability": {"log_level": "warning"},
        "services": {"api_port": 0, "startup_timeout_s": 120, "drain_timeout_s": 20},
    }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(tree))
    return path


def processes_using(config_path: Path) -> list[int]:
    """Live processes whose command line names ``config_path`` (a stack's services)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and str(config_path) in command_line(int(entry.name)):
            if is_running(int(entry.name)):
                found.append(int(entry.name))
    return found


class ServeProcess:
    """`python -m folio.cli serve` with its output in files under ``log_dir``."""

    def __init__(self, config_path: Path, log_dir: Path, *args: str,
                 env: dict[str, str] | None = None):
        self.out_path, self.err_path = log_dir / "serve.out", log_dir / "serve.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "folio.cli", "serve", "--config", str(config_path), *args],
            cwd=REPO, stdout=open(self.out_path, "w"), stderr=open(self.err_path, "w"),
            env={**os.environ, **(env or {})})
        self.url: str | None = None
        self.child_pids: set[int] = set()

    def output(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

    def wait_ready(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _READY.search(self.out_path.read_text())
            if match:
                self.url = match.group(1)
                self.child_pids = descendants(self.proc.pid)
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"folio serve exited {self.proc.returncode}:\n"
                                   f"{self.output()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"folio serve not ready in {timeout}s:\n{self.output()[-4000:]}")

    def pid_of(self, module: str) -> int:
        """The child running ``python -m <module>``."""
        for pid in self.child_pids:
            if module in command_line(pid):
                return pid
        raise LookupError(module)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            for pid in self.child_pids:
                if is_running(pid):
                    os.kill(pid, signal.SIGKILL)
            raise


@contextlib.contextmanager
def running(config: Path, log_dir: Path, env: dict[str, str] | None = None):
    """``folio serve`` on ``config`` (``env`` added to this process's environment), ready;
    checks it exits 0 when the block ends."""
    serve = ServeProcess(config, log_dir, env=env)
    try:
        serve.wait_ready()
        yield serve
    finally:
        assert serve.stop() == 0, serve.output()[-3000:]


def serving_default_model(tmp_path: Path, **model_settings):
    """``running`` on the default model with a 64 MiB KV pool (settings go to the
    ``model`` section)."""
    config = write_config(tmp_path / "folio.yaml", "default", None,
                          model={**model_settings, "served_model_name": None},
                          memory={"num_blocks": None, "kv_cache_bytes": 64 * 1024 ** 2})
    return running(config, tmp_path)
