"""What every service process does around its own work: arguments, config, logging,
uvloop, signals, and dying with the supervisor.

    python -m services.worker_service      --config config/default.yaml [--set k=v ...]
    python -m services.engine_core_service --config config/default.yaml [--set k=v ...]
    python -m services.api                 --config config/default.yaml [--set k=v ...]

``serve(config, args, stop)`` is the service's coroutine; ``stop`` is set on SIGTERM or
SIGINT (cancelling the start-up if it comes before ``stop.mark_serving()``) and the
coroutine returns the exit status. A start-up failure (bad config,
missing model, port in use, unreachable peer) is one line on stderr and exit status 1
(2 for a config error), never a traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable

import structlog
import uvloop

from config.loader import config_to_dict, load_config, parse_set_overrides
from config.schema import ConfigError, FolioConfig
from engine_core.model_facts import ModelFacts
from model_files.paths import served_model_name
from observability.logging import configure_logging, get_logger

SUPERVISOR_ENV = "FOLIO_SUPERVISOR_PID"
# Set when `folio serve` made the socket folder: if the supervisor dies (SIGKILL), the
# first child to exit removes the folder, so that no exit path leaves it behind.
OWNED_SOCKET_DIR_ENV = "FOLIO_OWNED_SOCKET_DIR"
# After the engine core goes away an API process keeps answering 503 this long (so that
# open streams get their error event) before it exits; the launcher waits for that.
ENGINE_LOSS_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1

class StopSignal(asyncio.Event):
    """Set on SIGTERM or SIGINT. Until the service calls ``mark_serving()`` a signal
    cancels its start-up at once (nothing is in flight yet to drain)."""

    def __init__(self):
        super().__init__()
        self.serving = False

    def mark_serving(self) -> None:
        self.serving = True


Serve = Callable[[FolioConfig, argparse.Namespace, StopSignal], Awaitable[int]]
log = get_logger(__name__)


def log_ready(service: str, config: FolioConfig, facts: ModelFacts, endpoint: object,
              **extra: object) -> None:
    """The one start-up line of a service at info: what it serves and where."""
    log.info(f"{service} ready", model=served_model_name(config.model.path,
                                                         config.model.served_model_name),
             dtype=facts.dtype, device=facts.device, num_kv_blocks=facts.num_blocks,
             num_kv_tokens=facts.num_blocks * facts.block_size,
             max_model_len=facts.max_model_len, endpoint=str(endpoint), **extra)


class ServiceStartError(RuntimeError):
    """A service cannot start; the message says what to fix."""


async def first_completed(*awaitables) -> tuple[list[asyncio.Future], set[asyncio.Future]]:
    """Run ``awaitables`` until one finishes, cancel the others; (all, the done ones)."""
    futures = [asyncio.ensure_future(a) for a in awaitables]
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    for future in pending:
        future.cancel()
    return futures, done


def service_arguments(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", default=None,
                        help="the YAML config (default: config/default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config key")
    parser.add_argument("--replica", type=int, default=0,
                        help="data-parallel replica served (engine core and worker; "
                        "0..parallel.data_parallel_size-1, which picks the sockets)")
    return parser


def _die_with_supervisor() -> None:
    """Under `folio serve`, exit when the supervisor dies, even by SIGKILL."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(supervisor):  # it died before prctl took effect
        sys.exit(1)


def _orphaned() -> bool:
    """Whether this process ran under `folio serve` and the supervisor is gone."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    return bool(supervisor) and os.getppid() != int(supervisor)


def _remove_orphaned_socket_dir() -> None:
    folder = os.environ.get(OWNED_SOCKET_DIR_ENV)
    if folder and _orphaned():
        shutil.rmtree(folder, ignore_errors=True)


def run_service(name: str, serve: Serve, parser: argparse.ArgumentParser,
                argv: list[str] | None = None) -> int:
    """Parse arguments, load the config and run ``serve`` under uvloop; the exit status."""
    args = parser.parse_args(argv)
    # SIGHUP means "reload the config" to a stack; only the engine core acts on it
    # (config_reload.py), and no service may die of one that comes early.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _die_with_supervisor()
    try:
        return _run_service(name, serve, args)
    finally:
        _remove_orphaned_socket_dir()


def _run_service(name: str, serve: Serve, args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, parse_set_overrides(args.overrides))
    except ConfigError as e:
        print(f"folio {name}: config error: {e}", file=sys.stderr)
        return 2
    configure_logging(config.observability.log_level, config.observability.log_format)
    structlog.contextvars.bind_contextvars(service=name)
    log.debug("config resolved", config=config_to_dict(config))

    async def main() -> int:
        stop = StopSignal()
        task = asyncio.current_task()

        def on_signal() -> None:
            stop.set()
            if not stop.serving:
                task.cancel()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            return await serve(config, args, stop)
        except asyncio.CancelledError:
            log.info("stopped during start-up")
            return 0

    try:
        status = uvloop.run(main())
    except (ServiceStartError, ConfigError, ConnectionError, OSError, ValueError) as e:
        # One actionable line for a person; JSON logs also get it as a record.
        if config.observability.log_format == "json":
            log.error("start-up failed", error=str(e))
        print(f"folio {name}: {e}", file=sys.stderr)
        return 1
    _ignore_late_stop()
    return status


def _ignore_late_stop() -> None:
    """The loop is gone, and its signal handlers with it: a SIGTERM that comes while
    the interpreter winds down (a tensor-parallel rank told to leave by rank 0 gets its
    own SIGTERM from a stopping launcher just then) would end a process that is already
    stopping as killed by a signal. Ignored from here on; a wind-down that hangs still
    gets the launcher's SIGKILL after its grace."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
