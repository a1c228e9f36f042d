"""Where each service listens, derived from the YAML ``services`` section.

    socket_dir/worker.sock        worker           (or services.worker_address)
    socket_dir/engine-core.sock   engine core      (or services.engine_core_address)
    socket_dir/worker-<r>.sock    replica r's worker and engine core, r >= 1
    socket_dir/engine-core-<r>.sock   (parallel.data_parallel_size > 1; replica 0 keeps
                                  the names above)
    socket_dir/api-<i>.sock       API process i: the same routes as its TCP port, so
                                  the launcher can probe each process's health alone
    api_host:api_port             the OpenAI-compatible API, shared by every API process
"""
from __future__ import annotations

from pathlib import Path

from config.schema import ConfigError, ServicesConfig
from services.transport import Endpoint


def _socket(services: ServicesConfig, name: str) -> Endpoint:
    if services.socket_dir is None:
        raise ConfigError("services.socket_dir: must be set when a service is started on "
                          "its own (`folio serve` makes one per run)", "services.socket_dir")
    return Endpoint(unix_path=str(Path(services.socket_dir).expanduser() / f"{name}.sock"))


def _replica_name(name: str, replica: int) -> str:
    return name if replica == 0 else f"{name}-{replica}"


def worker_endpoint(services: ServicesConfig, replica: int = 0) -> Endpoint:
    """Replica ``replica``'s worker: a TCP address when configured (one replica only,
    the config refuses more), else its unix socket."""
    if services.worker_address:
        return Endpoint.parse(services.worker_address)
    return _socket(services, _replica_name("worker", replica))


def engine_core_endpoint(services: ServicesConfig, replica: int = 0) -> Endpoint:
    """Replica ``replica``'s engine core: a TCP address when configured, else its unix
    socket."""
    if services.engine_core_address:
        return Endpoint.parse(services.engine_core_address)
    return _socket(services, _replica_name("engine-core", replica))


def api_admin_endpoint(services: ServicesConfig, index: int) -> Endpoint | None:
    """API process ``index``'s own unix socket; None when no socket folder is set."""
    return _socket(services, f"api-{index}") if services.socket_dir is not None else None
