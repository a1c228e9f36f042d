"""The serving sections of the config tree: `services` (processes, sockets,
supervision) and `api` (HTTP limits, keys, tenants)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from config.fields import _check, _f
from config.request_bounds import (ENGINE_MAX_GRAMMAR_CHARS, ENGINE_MAX_LOGPROBS,
                                   ENGINE_MAX_STOP_STRINGS)


@dataclass(frozen=True, slots=True)
class ServicesConfig:
    """Where the three services listen and how `folio serve` runs them."""

    socket_dir: str | None = _f(None, "folder of the services' unix sockets (made mode 0700); "
                                "null: `folio serve` makes a fresh private one per run")
    api_host: str = _f("127.0.0.1", "address the OpenAI-compatible API binds "
                       "(0.0.0.0 to serve other machines)")
    api_port: int = _f(8000, "TCP port of the API; 0 picks a free one (printed at start)")
    num_api_servers: int = _f(1, "API processes sharing the port (tokenization scales "
                              "with them; one engine core serves them all)")
    engine_core_address: str | None = _f(None, "host:port for the engine core instead of a "
                                         "unix socket (containers)")
    worker_address: str | None = _f(None, "host:port for the worker instead of a unix socket "
                                    "(containers)")
    startup_timeout_s: float = _f(600.0, "how long a service may take to become healthy "
                                  "(model load, first kernel build)")
    step_timeout_s: float = _f(120.0, "watchdog: a worker step slower than this is a hung "
                               "worker (/health 503, the stack stops with exit status 1)")
    drain_timeout_s: float = _f(30.0, "on SIGTERM, how long in-flight requests may take to "
                                "finish before the stack stops anyway")
    api_restart_budget: int = _f(5, "API process restarts `folio serve` allows in any 60 s "
                                 "(an API process that exits is restarted; past the budget "
                                 "the stack drains and stops)")
    watch_config: bool = _f(True, "re-read the YAML file when it changes and apply its "
                            "live keys (README, Live retune); SIGHUP and POST "
                            "/admin/reload_config reload either way")

    def __post_init__(self):
        _check(0 <= self.api_port <= 65535, "services.api_port", "must be in 0..65535")
        _check(1 <= self.num_api_servers <= 64, "services.num_api_servers", "must be in 1..64")
        for key in ("engine_core_address", "worker_address"):
            value = getattr(self, key)
            _check(value is None or _is_host_port(value), f"services.{key}",
                   f"must be host:port, got {value!r}")
        _check(self.startup_timeout_s > 0, "services.startup_timeout_s", "must be positive")
        _check(self.step_timeout_s > 0, "services.step_timeout_s", "must be positive")
        _check(self.drain_timeout_s >= 0, "services.drain_timeout_s", "must be non-negative")
        _check(self.api_restart_budget >= 0, "services.api_restart_budget",
               "must be non-negative")


def _is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) <= 65535


@dataclass(frozen=True, slots=True)
class APIConfig:
    """The HTTP API's request limits and authentication (see README, "Errors and limits")."""

    # secret: never in repr, and config_to_dict (start-up logs) writes "<redacted>"
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata={
        "doc": "keys accepted as 'Authorization: Bearer <key>', besides those in "
               "FOLIO_API_KEYS (comma-separated); none at all: no authentication",
        "secret": True})
    public_metrics: bool = _f(False, "serve /metrics without a key (/health is always "
                              "public)")
    public_poll_interval_s: float = _f(0.05, "a connection's /health and public /metrics "
                                       "requests without a valid key are answered at most "
                                       "one per this many seconds (an earlier one waits); "
                                       "0: no pacing")
    public_health_detail: bool = _f(False, "show /health's gauges (queue, KV usage, "
                                    "clients) without a key; /health's status is always "
                                    "public")
    max_body_bytes: int = _f(4 * 1024 * 1024, "largest request body in bytes (413 beyond)")
    max_header_bytes: int = _f(8190, "longest request line or header field in bytes (431 "
                               "beyond)")
    max_headers: int = _f(100, "most header fields in one request (431 beyond)")
    max_n: int = _f(16, "most samples one request may ask for ('n')")
    max_batch_prompts: int = _f(64, "most prompts one /v1/completions request may hold (a "
                                "list of texts or of token-id lists)")
    max_stop_strings: int = _f(ENGINE_MAX_STOP_STRINGS, "most stop strings per request "
                               f"(at most {ENGINE_MAX_STOP_STRINGS})")
    max_logprobs: int = _f(ENGINE_MAX_LOGPROBS, "most top logprobs per token (at most "
                           f"{ENGINE_MAX_LOGPROBS})")
    tenant_weights: dict[str, float] = field(default_factory=dict, metadata={
        "doc": "scheduler.policy fair: weight of each tenant (an API key), keyed by its "
               "tenant id (`folio tenant-id KEY` prints it); others weigh 1"})
    header_timeout_s: float = _f(10.0, "seconds a request line and its headers may take "
                                 "from their first byte (408 and close beyond)")
    body_timeout_s: float = _f(30.0, "seconds a request body may take from the end of its "
                               "headers (408 and close beyond)")
    keepalive_timeout_s: float = _f(15.0, "seconds a connection may sit idle before (or "
                                    "between) requests before it is closed")
    max_connections: int = _f(4096, "open client connections per API process; a new one "
                              "beyond gets 503 and is closed")
    max_buffered_body_bytes: int = _f(64 * 1024 * 1024, "request-body bytes one API process "
                                      "holds at once across requests (503 + Retry-After "
                                      "beyond); at least max_body_bytes")
    max_stop_string_chars: int = _f(1024, "longest stop string in characters")
    max_stop_token_ids: int = _f(256, "most stop_token_ids per request (at most the vocab)")
    tenant_body_bytes_per_s: int = _f(16 * 1024 * 1024, "request-body bytes a second one "
                                      "tenant (API key) may send per API process; beyond, "
                                      "a body is held unread for up to "
                                      "tenant_body_max_wait_s, then 429 + Retry-After; 0: "
                                      "no limit")
    tenant_body_burst_bytes: int = _f(16 * 1024 * 1024, "request-body bytes one tenant may "
                                      "send at once; at least max_body_bytes")
    tenant_body_max_wait_s: float = _f(5.0, "seconds a body over its tenant's rate may be "
                                       "held unread until the rate covers it (the client "
                                       "slows to the rate), at most half of "
                                       "body_timeout_s; a longer wait gets 429 at once; "
                                       "0: always 429")
    max_json_values: int = _f(262144, "most values (list items, object members) in one "
                              "JSON body, refused before parsing (400 beyond)")
    num_tokenizer_threads: int = _f(2, "threads per API process that tokenize and render "
                                    "chat templates off its event loop")
    allow_special_tokens_in_content: bool = _f(False, "chat content may write special "
                                               "tokens ('<|im_start|>'); false: plain text")
    max_grammar_chars: int = _f(65536, "longest grammar a request may constrain its output "
                                "with (a JSON schema's text, a regex, choices, EBNF), "
                                f"at most {ENGINE_MAX_GRAMMAR_CHARS}")
    grammar_compile_timeout_s: float = _f(2.0, "CPU seconds a request's grammar may take "
                                          "to compile in the API process (400 beyond)")

    @property
    def body_hold_s(self) -> float:
        """How long a body over its tenant's rate may be held: a held body's wait counts
        towards its read time (body_timeout_s), so at most half of that."""
        return min(self.tenant_body_max_wait_s, self.body_timeout_s / 2)

    def __post_init__(self):
        _check(all(k and k == k.strip() and "," not in k for k in self.api_keys),
               "api.api_keys", "keys must be non-empty, without commas or outer spaces")
        _check(self.max_body_bytes >= 1024, "api.max_body_bytes", "must be at least 1024")
        _check(self.max_header_bytes >= 256, "api.max_header_bytes", "must be at least 256")
        _check(self.max_headers >= 8, "api.max_headers", "must be at least 8")
        _check(self.max_n >= 1, "api.max_n", "must be at least 1")
        _check(self.max_batch_prompts >= 1, "api.max_batch_prompts", "must be at least 1")
        _check(1 <= self.max_stop_strings <= ENGINE_MAX_STOP_STRINGS, "api.max_stop_strings",
               f"must be in 1..{ENGINE_MAX_STOP_STRINGS}")
        _check(0 <= self.max_logprobs <= ENGINE_MAX_LOGPROBS, "api.max_logprobs",
               f"must be in 0..{ENGINE_MAX_LOGPROBS}")
        _check(all(math.isfinite(w) and w > 0 for w in self.tenant_weights.values()),
               "api.tenant_weights", "weights must be positive numbers")
        for key in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            _check(getattr(self, key) > 0, f"api.{key}", "must be positive")
        _check(self.max_connections >= 1, "api.max_connections", "must be at least 1")
        _check(self.max_buffered_body_bytes >= self.max_body_bytes,
               "api.max_buffered_body_bytes", "must be at least api.max_body_bytes (else "
               "the largest allowed body could never be read)")
        _check(self.max_stop_string_chars >= 1, "api.max_stop_string_chars", "must be >= 1")
        _check(self.max_stop_token_ids >= 0, "api.max_stop_token_ids", "must be >= 0")
        _check(self.tenant_body_bytes_per_s >= 0, "api.tenant_body_bytes_per_s",
               "must be >= 0")
        _check(self.tenant_body_bytes_per_s == 0
               or self.tenant_body_burst_bytes >= self.max_body_bytes,
               "api.tenant_body_burst_bytes", "must be at least api.max_body_bytes (else "
               "the largest allowed body could never be sent)")
        _check(self.tenant_body_max_wait_s >= 0, "api.tenant_body_max_wait_s",
               "must be >= 0")
        _check(0 <= self.public_poll_interval_s <= 10, "api.public_poll_interval_s",
               "must be in 0..10")
        _check(self.max_json_values >= 1024, "api.max_json_values", "must be at least 1024")
        _check(1 <= self.max_grammar_chars <= ENGINE_MAX_GRAMMAR_CHARS,
               "api.max_grammar_chars", f"must be in 1..{ENGINE_MAX_GRAMMAR_CHARS}")
        _check(self.grammar_compile_timeout_s > 0, "api.grammar_compile_timeout_s",
               "must be positive")
        _check(1 <= self.num_tokenizer_threads <= 64, "api.num_tokenizer_threads",
               "must be in 1..64")
