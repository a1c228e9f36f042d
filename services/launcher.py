"""`folio serve`: start the three services as processes, supervise them, drain on SIGTERM.

    folio serve ─┬─ python -m services.worker_service       (model + KV cache)
                 ├─ python -m services.worker_service --rank r  × (tensor_parallel_size-1)
                 ├─ python -m services.engine_core_service  (scheduler, step loop)
                 └─ python -m services.api  × num_api_servers (HTTP; one shared port)

With ``parallel.data_parallel_size`` n > 1 the worker and the engine core come n
times (``--replica r``: worker-r and engine-core-r, each pair with its own sockets and
KV pool), and every API process links to all of them (services/api/engine_replicas.py).

All children start at once (each retries its peer's socket), then the supervisor waits
for each one's /health in dependency order. The API port is bound here and the
listening socket handed to every API process (and kept, so that a restarted one gets
it too): a port in use fails before anything loads and several API processes share one
port. Children run in their own sessions (Ctrl-C reaches only the supervisor, which
then drains in order) and die with the supervisor even if it is SIGKILLed
(PR_SET_PDEATHSIG, see services/entrypoint.py).

Supervision: an API process that exits or dies is restarted, within
``services.api_restart_budget`` restarts a minute, while the others keep serving; past
the budget the stack drains and stops. The engine core's, the worker's or any
tensor-parallel rank's death stops the stack at once (they hold every request's state;
a rank has no health endpoint: rank 0 is healthy only once every rank has loaded).
With data-parallel replicas, a replica's engine core or worker that dies takes only
its replica down: the supervisor stops the replica's other process, says so, and keeps
serving on the others (the API processes route around it and /health reports it);
the stack stops when no replica is left. SIGTERM and SIGINT drain.

SIGHUP reloads the config (README, "Live retune"): it is passed to the engine core
(to each replica's, with data parallelism), the stack's config authority (services/engine_core_service/config_reload.py), which
re-reads the YAML, applies its live keys in every process or refuses the whole change.
The engine core also watches the file and answers POST /admin/reload_config.
The socket folder `folio serve` made is removed on every exit path: by the supervisor,
or, if the supervisor was killed, by whichever child exits first.

Exit status: 0 after a drain, 1 when a service died or failed to start (the message
names it), 2 for a config error.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import replace

from config.schema import FolioConfig
from services.endpoints import api_admin_endpoint, engine_core_endpoint, worker_endpoint
from services.entrypoint import (ENGINE_LOSS_GRACE_S, OWNED_SOCKET_DIR_ENV, SUPERVISOR_ENV,
                                 first_completed)
from services.service_process import RestartBudget, ServiceDied, ServiceProcess
from services.transport import probe_health

STOP_GRACE_S = 10.0  # after SIGTERM, how long a child may take before SIGKILL
HEALTH_POLL_S = 0.2


class Launcher:
    """Runs a stack for one config; ``run()`` returns the exit status."""

    def __init__(self, config: FolioConfig, config_path: str | None, overrides: list[str],
                 out=sys.stdout):
        self.config_path = config_path
        self.overrides = list(overrides)
        self.out = out
        self._own_socket_dir = config.services.socket_dir is None
        if self._own_socket_dir:
            socket_dir = tempfile.mkdtemp(prefix="folio-")  # mode 0700
            config = replace(config, services=replace(config.services, socket_dir=socket_dir))
            self.overrides.append(f"services.socket_dir={socket_dir}")
        if config.parallel.is_enabled and not config.parallel.master_port:
            config = replace(config, parallel=config.parallel.with_rendezvous_port())
            self.overrides.append(f"parallel.master_port={config.parallel.master_port}")
        self.config = config
        self.children: list[ServiceProcess] = []
        self._stop = asyncio.Event()
        self._api_sock: socket.socket | None = None
        self._restarts = RestartBudget(config.services.api_restart_budget)

    def _say(self, text: str) -> None:
        print(f"[folio] {text}", file=self.out, flush=True)

    def _bind_api_socket(self) -> socket.socket:
        services = self.config.services
        try:
            sock = socket.create_server((services.api_host, services.api_port), backlog=1024)
        except OSError as e:
            raise OSError(f"cannot listen on {services.api_host}:{services.api_port} "
                          f"(services.api_host/api_port): {e.strerror}") from None
        sock.set_inheritable(True)
        return sock

    async def _spawn(self, child: ServiceProcess) -> None:
        argv = [sys.executable, "-m", child.module]
        if self.config_path:
            argv += ["--config", self.config_path]
        for override in self.overrides:
            argv += ["--set", override]
        env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})
        if self._own_socket_dir:
            env[OWNED_SOCKET_DIR_ENV] = self.config.services.socket_dir
        child.process = await asyncio.create_subprocess_exec(
            *argv, *child.extra_args, env=env, pass_fds=child.pass_fds,
            start_new_session=True)
        if child not in self.children:
            self.children.append(child)

    async def _wait_healthy(self, child: ServiceProcess, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if child.health is None:
            return
        while True:
            for c in self.children:  # a rank that dies leaves rank 0 waiting for it
                if c.process.returncode is not None:
                    raise ServiceDied(f"{c.name} exited with status {c.process.returncode} "
                                      f"during start-up (its error is above)")
            status, _ = await probe_health(child.health, timeout=2.0)
            if status == 200:
                return
            if loop.time() > deadline or self._stop.is_set():
                raise ServiceDied(f"{child.name} did not become healthy within "
                                  f"{self.config.services.startup_timeout_s:.0f}s")
            await asyncio.sleep(HEALTH_POLL_S)

    async def _start(self) -> str:
        services = self.config.services
        # kept open until the end: a restarted API process gets the same socket
        self._api_sock = api_sock = self._bind_api_socket()
        host, port = api_sock.getsockname()[:2]
        await self._spawn_replicas()
        fd = api_sock.fileno()
        for i in range(services.num_api_servers):
            await self._spawn(ServiceProcess(
                f"api-{i}", api_admin_endpoint(services, i), "services.api",
                ("--index", str(i), "--listen-fd", str(fd)), pass_fds=(fd,)))
        deadline = asyncio.get_running_loop().time() + services.startup_timeout_s
        for child in self.children:
            await self._wait_healthy(child, deadline)
        return f"http://{host}:{port}"

    async def _spawn_replicas(self) -> None:
        """Each replica's worker (with its tensor-parallel ranks) and engine core."""
        services, parallel = self.config.services, self.config.parallel
        num_replicas = parallel.data_parallel_size
        for r in range(num_replicas):
            tag = f"-{r}" if num_replicas > 1 else ""
            args = ("--replica", str(r)) if num_replicas > 1 else ()
            replica = r if num_replicas > 1 else None
            await self._spawn(ServiceProcess(f"worker{tag}", worker_endpoint(services, r),
                                             "services.worker_service", args,
                                             replica=replica))
            for rank in range(1, parallel.tensor_parallel_size):
                await self._spawn(ServiceProcess(f"worker-rank-{rank}", None,
                                                 "services.worker_service",
                                                 ("--rank", str(rank))))
            await self._spawn(ServiceProcess(f"engine-core{tag}",
                                             engine_core_endpoint(services, r),
                                             "services.engine_core_service", args,
                                             replica=replica))

    async def _first_exit(self) -> ServiceProcess | None:
        futures, done = await first_completed(self._stop.wait(),
                                              *(c.process.wait() for c in self.children))
        exited = [c for c, f in zip(self.children, futures[1:]) if f in done]
        return exited[0] if exited else None

    async def _terminate(self, children: list[ServiceProcess], grace: float) -> None:
        live = [c for c in children if c.process.returncode is None]
        for c in live:
            c.process.send_signal(signal.SIGTERM)
            c.process.send_signal(signal.SIGCONT)  # a stopped child must run to obey it
        try:
            await asyncio.wait_for(asyncio.gather(*(c.process.wait() for c in live)), grace)
        except asyncio.TimeoutError:
            for c in live:
                if c.process.returncode is None:
                    self._say(f"{c.name} did not stop within {grace:.0f}s; killing it")
                    c.process.kill()
            await asyncio.gather(*(c.process.wait() for c in live))

    async def _stop_after_death(self, died: ServiceProcess) -> None:
        """An API process past its restart budget: drain the rest. The engine core or
        the worker: stop the core services at once; API processes first answer 503 for a
        moment and end open streams with an error event, then exit by themselves."""
        apis = [c for c in self.children if c.is_api]
        if died.is_api:
            await self._drain()
            return
        await self._terminate([c for c in self.children if c not in apis], STOP_GRACE_S)
        try:
            await asyncio.wait_for(asyncio.gather(*(c.process.wait() for c in apis)),
                                   ENGINE_LOSS_GRACE_S + STOP_GRACE_S)
        except asyncio.TimeoutError:
            pass
        await self._terminate(apis, STOP_GRACE_S)

    async def _drain(self) -> None:
        """APIs first (they finish in-flight requests), then the engine core and worker."""
        apis = [c for c in self.children if c.is_api]
        self._say("draining: new requests get 503, in-flight requests finish")
        await self._terminate(apis, self.config.services.drain_timeout_s + STOP_GRACE_S)
        await self._terminate([c for c in self.children if c not in apis], STOP_GRACE_S)

    def _on_signal(self, sig: signal.Signals) -> None:
        if sig == signal.SIGHUP:
            self._forward_reload()
            return
        self._stop.set()

    def _forward_reload(self) -> None:
        """SIGHUP: each engine core reloads the config (and logs what changed)."""
        cores = [c for c in self.children if c.module == "services.engine_core_service"
                 and c.process is not None and c.process.returncode is None]
        if not cores:
            self._say("SIGHUP: no engine core is running; nothing reloaded")
            return
        self._say("SIGHUP: reloading the config")
        for core in cores:
            core.process.send_signal(signal.SIGHUP)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            try:
                url = await self._start()
            except (ServiceDied, OSError) as e:
                self._say(f"start-up failed: {e}")
                await self._terminate(self.children, STOP_GRACE_S)
                return 1
            if self._stop.is_set():
                await self._drain()
                return 0
            self._say(f"API listening on {url} (model {self._model_name()}); "
                      f"{self.config.services.num_api_servers} API process(es), "
                      f"{self.config.parallel.data_parallel_size} engine replica(s); "
                      f"Ctrl-C drains and stops")
            return await self._supervise()
        finally:
            if self._api_sock is not None:
                self._api_sock.close()
            if self._own_socket_dir:
                shutil.rmtree(self.config.services.socket_dir, ignore_errors=True)

    async def _supervise(self) -> int:
        """Until a stop signal (drain, 0) or a death the stack cannot survive (1)."""
        while True:
            died = await self._first_exit()
            if died is None:
                await self._drain()
                self._say("stopped")
                return 0
            status = died.process.returncode
            if died.is_api and self._restarts.take():
                self._say(f"{died.name} exited (status {status}); restarting it")
                await self._spawn(died)
                continue
            if died.replica is not None and await self._lose_replica(died):
                continue
            if died.is_api:
                self._say(f"{died.name} exited (status {status}) and the restart budget "
                          f"(services.api_restart_budget) is spent; stopping")
            else:
                self._say(f"{died.name} died (exit status {status}); stopping the other "
                          f"services")
            await self._stop_after_death(died)
            return 1

    async def _lose_replica(self, died: ServiceProcess) -> bool:
        """A data-parallel replica's process died: stop its partner and serve on the
        other replicas (True), or False when it was the last replica."""
        mates = [c for c in self.children if c.replica == died.replica]
        left = {c.replica for c in self.children if c.replica not in (None, died.replica)}
        if not left:
            return False
        self._say(f"{died.name} died (exit status {died.process.returncode}); replica "
                  f"{died.replica} is down, serving on replica(s) {sorted(left)}")
        await self._terminate(mates, STOP_GRACE_S)
        self.children = [c for c in self.children if c not in mates]
        return True

    def _model_name(self) -> str:
        from model_files.paths import served_model_name
        return served_model_name(self.config.model.path, self.config.model.served_model_name)


def serve(config: FolioConfig, config_path: str | None, overrides: list[str]) -> int:
    """Entry of `folio serve`."""
    import uvloop
    return uvloop.run(Launcher(config, config_path, overrides).run())
