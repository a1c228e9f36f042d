"""Live retune: the engine core is the stack's one authority on its running config.

    YAML edited (watchfiles) ─┐
    SIGHUP ───────────────────┼─▶ reload(): load + check the file (config/loader.py)
    ReloadConfig from any API ┘      │  diff against the running config (live_config.py)
                                     ├─ invalid / refused / unchanged: nothing changes
                                     └─ applicable: the step loop applies it between two
                                        steps (inbox), then every API process gets a
                                        ConfigUpdate; the asking API process then gets
                                        ConfigReloaded (on the same link, after its update)

The engine core is the one process every API process is linked to, under `folio serve`
and in docker-compose alike, so one reload reaches them all, and a restarted API
process gets the running config when it joins. `folio serve` forwards SIGHUP here.
All-or-nothing: a reload with any refused key or bad value changes no process.
Each reload is one log line, one ``config.reload`` span (sampled whatever the ratio)
and one count in ``<prefix>:config_reloads_total{result}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

from config.live_config import config_to_json, diff_configs
from config.loader import DEFAULT_CONFIG_PATH, load_config
from config.schema import ConfigError, FolioConfig
from engine_core.live_limits import apply_live_limits
from observability.logging import configure_logging, get_logger
from services.engine_core_service.api_clients import send_to_client
from services.protocol import ConfigReloaded, ConfigUpdate

log = get_logger("services.engine_core")
RESULTS = ("applied", "unchanged", "refused", "invalid")
APPLY_TIMEOUT_S = 60.0  # the step loop applies a retune after its current step
WATCH_DEBOUNCE_MS = 300  # an editor's save is often several writes: grouped up to this


class PendingRetune:
    """A checked config waiting in the step loop's inbox; ``apply()`` runs there."""

    def __init__(self, reloader: "ConfigReloader", config: FolioConfig):
        self.reloader, self.config = reloader, config
        self.done = asyncio.get_running_loop().create_future()

    def apply(self) -> None:
        try:
            self.reloader.apply_in_loop(self.config)
        except Exception as e:  # noqa: BLE001 (reported to the caller; the loop goes on)
            self.done.set_exception(e)
        else:
            self.done.set_result(None)


class ConfigReloader:
    """Re-reads one YAML file (with the start-up overrides) and applies its live keys."""

    def __init__(self, core, config_path: str | None, overrides: dict):
        self.core = core  # the EngineCoreService
        self.path = Path(config_path) if config_path else DEFAULT_CONFIG_PATH
        self.has_file = config_path is not None  # the packaged default is not watched
        self.overrides = dict(overrides)
        self.startup = self.running = core.config
        self._lock = asyncio.Lock()  # one reload at a time, in the order asked
        self._tasks: set[asyncio.Task] = set()  # reloads in progress (kept referenced)
        self._counter = None
        metrics = core.observer.metrics if core.observer is not None else None
        if metrics is not None:
            from prometheus_client import Counter
            self._counter = Counter(
                f"{core.config.observability.metrics_prefix}:config_reloads",
                "Config reloads by result (applied, unchanged, refused, invalid)",
                ["result"], registry=metrics.registry)
            for result in RESULTS:
                self._counter.labels(result=result)

    @property
    def is_cuda(self) -> bool:
        ready = self.core.ready
        return ready is not None and ready.facts.device.startswith("cuda")

    async def reload(self, trigger: str, request_id: str = "") -> ConfigReloaded:
        """Re-read the file and apply it if every changed key is live."""
        async with self._lock:
            tracer = self.core.tracing.tracer if self.core.tracing is not None else None
            span_cm = (tracer.start_as_current_span("config.reload") if tracer is not None
                       else contextlib.nullcontext())
            with span_cm as span:
                reply = await self._reload(request_id)
                if span is not None:
                    span.set_attributes({"folio.config.file": str(self.path),
                                         "folio.config.trigger": trigger,
                                         "folio.config.result": reply.result,
                                         "folio.config.changed": reply.changed,
                                         "folio.config.refused": reply.refused})
            if self._counter is not None:
                self._counter.labels(result=reply.result).inc()
            fields = dict(file=str(self.path), trigger=trigger, result=reply.result,
                          changed=reply.changed)
            if reply.result == "applied" or reply.result == "unchanged":
                log.info("config reloaded", **fields)
            else:
                log.error("config reload refused; the running config is unchanged",
                          refused=reply.refused, key=reply.key, error=reply.message,
                          **fields)
            return reply

    async def _reload(self, request_id: str) -> ConfigReloaded:
        try:
            new = load_config(self.path, self.overrides)
        except ConfigError as e:
            # the reply names the file, not its path (the log line has the path)
            return ConfigReloaded(request_id, "invalid", key=e.key, message=str(e).replace(
                str(self.path), self.path.name))
        diff = diff_configs(self.running, new, self.startup, self.is_cuda)
        if not diff.changed:
            return ConfigReloaded(request_id, "unchanged")
        if not diff.is_applicable:
            return ConfigReloaded(request_id, "refused", list(diff.changed),
                                  diff.refused_keys,
                                  "; ".join(str(r) for r in diff.refusals))
        pending = PendingRetune(self, new)
        self.core.inbox.append((None, pending))
        self.core._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(pending.done), APPLY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 (timeout, or the engine's own check)
            return ConfigReloaded(request_id, "invalid", list(diff.changed),
                                  message=f"the engine core could not apply it: {e}")
        for link in list(self.core.clients.links):
            await send_to_client(link, self.update())
        return ConfigReloaded(request_id, "applied", list(diff.changed))

    def apply_in_loop(self, new: FolioConfig) -> None:
        """Between two steps: the engine, the tracer and the logs take ``new``."""
        core = self.core
        apply_live_limits(core.engine, new.scheduler,
                          new.speculative if new.speculative.is_enabled else None)
        obs, old_obs = new.observability, self.running.observability
        if core.observer is not None and core.observer.tracer is not None:
            core.observer.tracer.per_step = obs.trace_step_detail == "step"
        if core.tracing is not None:
            core.tracing.set_sample_ratio(obs.trace_sample_ratio)
        if obs.log_level != old_obs.log_level:
            configure_logging(obs.log_level, obs.log_format)
        core.config = self.running = new

    def update(self) -> ConfigUpdate:
        """The running config, for an API process."""
        return ConfigUpdate(config_to_json(self.running))

    async def watch(self) -> None:
        """Reload whenever the file changes. The folder is watched, not the file: an
        editor that saves by writing a new file and renaming it over the old one (and
        Kubernetes' ConfigMap symlink swap, ``..data``) replaces the inode."""
        import watchfiles
        name = self.path.name

        def is_ours(change, path: str) -> bool:
            return Path(path).name in (name, "..data")

        folder = self.path.resolve().parent
        log.debug("watching the config file", file=str(self.path))
        async for _ in watchfiles.awatch(folder, watch_filter=is_ours,
                                         debounce=WATCH_DEBOUNCE_MS, recursive=False):
            await self.reload("file")

    def answer(self, link, message) -> None:
        """An API process's ReloadConfig: reload off its handler, then reply on its link."""
        async def run() -> None:
            reply = await self.reload("api", message.request_id)
            await send_to_client(link, reply)
        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def reload_triggers(reloader: ConfigReloader) -> None:
    """SIGHUP and (with ``services.watch_config`` and a --config file) the file watch,
    until cancelled. Never returns: a watch that fails is logged and SIGHUP still works."""
    loop = asyncio.get_running_loop()
    tasks = reloader._tasks

    def on_sighup() -> None:
        task = loop.create_task(reloader.reload("SIGHUP"))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    try:
        if reloader.running.services.watch_config and reloader.has_file:
            try:
                await reloader.watch()
            except Exception as e:  # noqa: BLE001 (a missing folder, no inotify...)
                log.error("cannot watch the config file; SIGHUP and "
                          "/admin/reload_config still reload it", file=str(reloader.path),
                          error=str(e))
        await asyncio.Event().wait()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # not the default: that kills
