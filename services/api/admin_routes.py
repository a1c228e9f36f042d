"""Live retune in an API process: /admin/config, /admin/reload_config, and taking the
live keys of the running config the engine core pushes (ConfigUpdate).

    GET  /admin/config         this process's running config, secrets redacted
    POST /admin/reload_config  the engine core re-reads the YAML (the one path every
                               trigger takes, config_reload.py); 200 with the changed
                               keys, or 400 naming each refused key or the bad one

Both are behind the API key when keys are configured (auth.py: neither is public).
Only the keys config/live_config.py calls live are taken from a pushed config; every
other key stays what this process started with (a reload that changes one is refused
before any process sees it).
"""
from __future__ import annotations

import dataclasses
import os

from aiohttp import web

from config.live_config import LIVE_KEYS, config_from_json
from config.loader import config_to_dict
from config.schema import ConfigError, FolioConfig
from observability.logging import configure_logging, get_logger
from services.api.auth import APIKeys
from services.api.engine_client import EngineDead
from services.api.openai_protocol import APIError, unavailable
from services.api.request_validation import ValidationLimits

log = get_logger(__name__)


def take_live_keys(own: FolioConfig, pushed: FolioConfig) -> FolioConfig:
    """``own`` with every live key taken from ``pushed`` (what /admin/config shows; this
    process acts on the api and observability ones)."""
    sections: dict[str, dict] = {}
    for dotted in LIVE_KEYS:
        section, key = dotted.split(".")
        sections.setdefault(section, {})[key] = getattr(getattr(pushed, section), key)
    return dataclasses.replace(own, **{
        section: dataclasses.replace(getattr(own, section), **values)
        for section, values in sections.items()})


class AdminRoutes:
    """The admin routes of one API process and its side of a live retune."""

    def __init__(self, server, config: FolioConfig, tracing=None):
        self.server = server  # the APIServer
        self.config = config
        self.tracing = tracing

    def follow(self, engine) -> None:
        """Take every config the engine core pushes, starting with the one it sent on
        joining (a process restarted after a reload gets the running config)."""
        engine.on_config = self.on_config
        if engine.config_json is not None:
            self.on_config(engine.config_json)

    def add_to(self, router: web.UrlDispatcher, expect_handler=None) -> None:
        router.add_get("/admin/config", self.show, expect_handler=expect_handler)
        router.add_post("/admin/reload_config", self.reload, expect_handler=expect_handler)

    async def show(self, request: web.Request) -> web.Response:
        return web.json_response(config_to_dict(self.config))

    async def reload(self, request: web.Request) -> web.Response:
        try:
            reply = await self.server.engine.reload_config()
        except (EngineDead, TimeoutError):
            raise unavailable("the engine core is unavailable")
        if reply.result == "refused":
            raise APIError(400, f"the config was not changed: restart-only keys changed "
                           f"({reply.message})", param=",".join(reply.refused),
                           code="restart_required")
        if reply.result == "invalid":
            raise APIError(400, f"the config was not changed: {reply.message}",
                           param=reply.key, code="invalid_config")
        return web.json_response({"result": reply.result, "changed": reply.changed})

    def on_config(self, config_json: str) -> None:
        """A ConfigUpdate from the engine core: take its live keys now."""
        try:
            new = take_live_keys(self.config, config_from_json(config_json))
        except ConfigError as e:  # restart-only keys differ from the file we started on
            log.error("cannot take the running config's live keys", error=str(e))
            return
        if new != self.config:
            self._apply(new)

    def _apply(self, new: FolioConfig) -> None:
        server, api, obs = self.server, new.api, new.observability
        server.api = api
        server.api_keys = APIKeys.from_sources(api.api_keys, os.environ)
        server.auth.keys = server.api_keys
        server.auth.public = frozenset(server.public_paths())
        limits = server.validator.limits
        server.validator.limits = ValidationLimits.from_config(
            api, limits.max_model_len, limits.vocab_size, limits.token_span)
        server.body_budget.max_bytes = api.max_buffered_body_bytes
        server.body_rate.bytes_per_s = api.tenant_body_bytes_per_s
        server.body_rate.burst_bytes = api.tenant_body_burst_bytes
        server.body_rate.max_wait_s = api.body_hold_s
        server.public_pacing.interval_s = api.public_poll_interval_s
        server.connections.api = api
        server.grammars.timeout_s = api.grammar_compile_timeout_s
        if self.tracing is not None:
            self.tracing.set_sample_ratio(obs.trace_sample_ratio)
        if obs.log_level != self.config.observability.log_level:
            configure_logging(obs.log_level, obs.log_format)
        self.config = new
