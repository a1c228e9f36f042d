"""The config tree: one frozen dataclass per YAML section, one documented field per key.

Each field's ``metadata["doc"]`` is its one-line description; the loader uses it for
error messages and ``folio config`` prints it. Validation lives next to the fields in
``__post_init__`` so a bad value is rejected however the tree was built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from config.fields import ConfigError, _check, _f  # noqa: F401 (ConfigError: re-exported)
from config.speculative import SpeculativeConfig

# The engine's own hard bounds (SamplingParams enforces them); the API's limits may
# only be stricter.
ENGINE_MAX_LOGPROBS = 20
ENGINE_MAX_STOP_STRINGS = 16
# No vocabulary Folio serves is larger; the engine core also caps stop_token_ids at the
# model's own vocabulary size.
ENGINE_MAX_STOP_TOKEN_IDS = 262_144


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to serve and how to hold its weights."""

    path: str = _f("default", "GGUF file or Hugging Face checkpoint folder; 'default' is the "
                   "bundled SmolLM2-135M-Instruct")
    dtype: str = _f("auto", "weight and activation dtype: auto|float32|bfloat16|float16 "
                    "(auto: bfloat16 on GPUs and bf16-capable CPUs, else float32)")
    max_model_len: int | None = _f(None, "longest prompt + output in tokens; null takes the "
                                   "model's own limit")
    tokenizer: str | None = _f(None, "tokenizer.json or folder; null reads it from the model")
    seed: int = _f(0, "seed for requests that give none")
    served_model_name: str | None = _f(None, "the name clients pass as 'model'; null takes "
                                       "the model file's or folder's name")

    def __post_init__(self):
        _check(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1, "model.max_model_len",
               f"must be at least 1, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """How much memory the KV cache may take, and its page size."""

    kv_cache_bytes: int = _f(2 * 1024 ** 3, "KV-cache budget in bytes on the CPU")
    gpu_memory_utilization: float = _f(0.9, "fraction of GPU memory Folio may use in all "
                                       "(weights, activations, KV cache); the KV pool gets "
                                       "what a profiling step at the largest batch leaves")
    block_size: int = _f(16, "tokens per KV-cache block (page)")
    num_blocks: int | None = _f(None, "force the number of KV blocks (tests, tuning); null "
                                "sizes the pool from the budget")

    def __post_init__(self):
        _check(self.kv_cache_bytes > 0, "memory.kv_cache_bytes", "must be positive")
        _check(0 < self.gpu_memory_utilization <= 1, "memory.gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "memory.block_size",
               f"must be a power of two up to 256, got {self.block_size}")
        _check(self.num_blocks is None or self.num_blocks >= 2, "memory.num_blocks",
               "must be at least 2 (block 0 is the null block)")


POLICIES = ("fcfs", "priority", "fair")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits and policy."""

    max_num_seqs: int = _f(128, "most requests running in one step")
    max_num_batched_tokens: int = _f(2048, "token budget of one step (prefill chunks + decodes)")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps under the budget")
    policy: str = _f("fcfs", "fcfs (arrival order), priority (lower priority value first) "
                     "or fair (tenants share slots and tokens by weight: deficit round "
                     "robin, weights per request from api.tenant_weights)")
    max_num_queued_requests: int = _f(1024, "served requests that may wait beyond the "
                                      "max_num_seqs running ones; past it new ones get 503 "
                                      "+ Retry-After (the engine core enforces it for all "
                                      "API processes; the offline LLM is not limited)")
    max_num_queued_tokens: int | None = _f(None, "while requests wait, cap on the prompt "
                                           "tokens of all waiting requests (503 past it); "
                                           "null: no token cap")

    def __post_init__(self):
        _check(self.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be at least 1")
        _check(self.max_num_queued_requests >= 0, "scheduler.max_num_queued_requests",
               "must be non-negative")
        _check(self.max_num_queued_tokens is None or self.max_num_queued_tokens >= 1,
               "scheduler.max_num_queued_tokens", "must be at least 1 (or null)")
        _check(self.max_num_batched_tokens >= 1, "scheduler.max_num_batched_tokens",
               "must be at least 1")
        _check(self.policy in POLICIES, "scheduler.policy",
               f"must be one of {POLICIES}, got {self.policy!r}")


HASH_ALGOS = ("sha256", "xxhash128")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Automatic prefix caching."""

    enable_prefix_caching: bool = _f(True, "reuse KV blocks of identical prompt prefixes")
    hash_algorithm: str = _f("sha256", "block hash digest: sha256 or xxhash128")

    def __post_init__(self):
        _check(self.hash_algorithm in HASH_ALGOS, "cache.hash_algorithm",
               f"must be one of {HASH_ALGOS}, got {self.hash_algorithm!r}")


DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Where and how the model runs."""

    device: str = _f("auto", "auto|cpu|cuda (auto: cuda when available)")
    num_threads: int = _f(0, "CPU threads for torch; 0 keeps torch's default (all cores)")
    attention_backend: str = _f("auto", "auto (Triton kernels on CUDA; on a CPU the native "
                                "decode kernel when it builds, else torch), torch (the "
                                "reference everywhere) or triton (on a CPU only under "
                                "TRITON_INTERPRET=1, for tests)")
    enforce_eager: bool = _f(False, "CUDA: run every step eagerly; false captures decode "
                             "steps as CUDA graphs over a ladder of batch sizes (1, 2, 4, 8, "
                             "16, 32, ... up to scheduler.max_num_seqs, at most 512)")
    k_major_weights: bool = _f(True, "CPU: store float32 linear weights K-major ([in, out] "
                               "contiguous), 1.5-5x faster matmuls at 4-32 rows; a tied LM "
                               "head gets its own copy (vocab x hidden more memory). 16-bit "
                               "weights stay row-major where the native kernel reads them")

    def __post_init__(self):
        _check(self.device in DEVICES, "worker.device",
               f"must be one of {DEVICES}, got {self.device!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "worker.attention_backend",
               f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _check(self.num_threads >= 0, "worker.num_threads", "must be non-negative")


LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
TRACE_STEP_DETAILS = ("step", "phase")


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """Logs, traces (OpenTelemetry, OTLP) and metrics (Prometheus at the API's /metrics)."""

    log_level: str = _f("info", "debug|info|warning|error")
    log_format: str = _f("console", "console (human) or json (one object per line)")
    log_prompts: bool = _f(False, "allow prompt and completion text in logs and spans")
    otlp_endpoint: str | None = _f(None, "OTLP collector for traces, e.g. "
                                   "http://localhost:4318 (http/protobuf) or "
                                   "http://localhost:4317 (grpc); null turns tracing off")
    otlp_protocol: str = _f("http/protobuf", "http/protobuf or grpc")
    trace_sample_ratio: float = _f(1.0, "fraction of requests traced (a client's sampled "
                                   "traceparent is always followed)")
    trace_step_detail: str = _f("step", "per-request engine spans: 'step' (one per engine "
                                "step; +1.1% CPU with every request traced) or 'phase' (one "
                                "for prefill, one for decode; +0.4%), measured by "
                                "benchmarks/tracing_overhead.py")
    enable_metrics: bool = _f(True, "serve Prometheus metrics at the API's /metrics")

    def __post_init__(self):
        _check(self.log_level in LOG_LEVELS, "observability.log_level",
               f"must be one of {LOG_LEVELS}")
        _check(self.log_format in LOG_FORMATS, "observability.log_format",
               f"must be one of {LOG_FORMATS}")
        _check(self.otlp_protocol in OTLP_PROTOCOLS, "observability.otlp_protocol",
               f"must be one of {OTLP_PROTOCOLS}")
        _check(0.0 <= self.trace_sample_ratio <= 1.0, "observability.trace_sample_ratio",
               "must be in [0, 1]")
        _check(self.trace_step_detail in TRACE_STEP_DETAILS, "observability.trace_step_detail",
               f"must be one of {TRACE_STEP_DETAILS}")


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
    public_health_detail: bool = _f(False, "show /health's gauges (queue, KV usage, "
                                    "clients) without a key; /health's status is always "
                                    "public")
    max_body_bytes: int = _f(4 * 1024 * 1024, "largest request body in bytes (413 beyond)")
    max_header_bytes: int = _f(8190, "longest request line or header field in bytes (431 "
                               "beyond)")
    max_headers: int = _f(100, "most header fields in one request (431 beyond)")
    max_n: int = _f(16, "most samples one request may ask for ('n')")
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
    num_tokenizer_threads: int = _f(2, "threads per API process that tokenize and render "
                                    "chat templates off its event loop")
    allow_special_tokens_in_content: bool = _f(False, "chat content may write special "
                                               "tokens ('<|im_start|>'); false: plain text")

    def __post_init__(self):
        _check(all(k and k == k.strip() and "," not in k for k in self.api_keys),
               "api.api_keys", "keys must be non-empty, without commas or outer spaces")
        _check(self.max_body_bytes >= 1024, "api.max_body_bytes", "must be at least 1024")
        _check(self.max_header_bytes >= 256, "api.max_header_bytes", "must be at least 256")
        _check(self.max_headers >= 8, "api.max_headers", "must be at least 8")
        _check(self.max_n >= 1, "api.max_n", "must be at least 1")
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
        _check(1 <= self.num_tokenizer_threads <= 64, "api.num_tokenizer_threads",
               "must be in 1..64")


@dataclass(frozen=True, slots=True)
class FolioConfig:
    """The whole tree; one YAML file fills it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    api: APIConfig = field(default_factory=APIConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
