"""The config tree: one frozen dataclass per YAML section, one documented field per key.

Each field's ``metadata["doc"]`` is its one-line description; the loader uses it for
error messages and ``folio config`` prints it. Validation lives next to the fields in
``__post_init__`` so a bad value is rejected however the tree was built. The serving
sections (`services`, `api`) live in serving.py, `lora` in lora.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# ConfigError and every section are importable from here: the tree's one front door.
from config.deterministic import check_deterministic_supported
from config.fields import ConfigError, _check, _f  # noqa: F401
from config.lora import LoRAConfig
from config.parallel import ParallelConfig
from config.serving import APIConfig, ServicesConfig
from config.speculative import SpeculativeConfig


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "gguf")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to serve and how to hold its weights."""

    path: str = _f("default", "GGUF file or Hugging Face checkpoint folder; 'default' is the "
                   "bundled SmolLM2-135M-Instruct")
    dtype: str = _f("auto", "weight and activation dtype: auto|float32|bfloat16|float16 "
                    "(auto: bfloat16 on GPUs and bf16-capable CPUs, else float32)")
    quantization: str = _f("none", "none|auto|int8|gguf (CPU): gguf keeps a GGUF's Q4_0/"
                           "Q4_1/Q8_0/Q4_K/Q6_K matrices quantized (native kernels); int8 "
                           "quantizes linear weights per channel on load; none "
                           "dequantises to dtype (the default); auto: gguf for a quantized "
                           "GGUF, else none. Not with tensor parallelism, sleep level 2 "
                           "or weight updates")
    max_model_len: int | None = _f(None, "longest prompt + output in tokens; null takes the "
                                   "model's own limit")
    tokenizer: str | None = _f(None, "tokenizer.json or folder; null reads it from the model")
    seed: int = _f(0, "seed for requests that give none")
    served_model_name: str | None = _f(None, "the name clients pass as 'model'; null takes "
                                       "the model file's or folder's name")

    def __post_init__(self):
        _check(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.quantization in QUANTIZATIONS, "model.quantization",
               f"must be one of {QUANTIZATIONS}, got {self.quantization!r}")
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
    kv_cache_dtype: str = _f("auto", "KV cache storage: auto (the model dtype) | fp8 (= "
                             "fp8_e4m3) | fp8_e5m2: one byte per element, so the same bytes "
                             "hold 2x the tokens of bfloat16 (4x of float32); keys and values "
                             "are rounded on store (scale 1.0, saturating) and widened on "
                             "load | int8: a scale per token and KV head (1.94x the tokens "
                             "at head_dim 64, the closest to bf16's perplexity; CPU and the "
                             "torch attention backend only)")

    def __post_init__(self):
        _check(self.kv_cache_bytes > 0, "memory.kv_cache_bytes", "must be positive")
        _check(0 < self.gpu_memory_utilization <= 1, "memory.gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "memory.block_size",
               f"must be a power of two up to 256, got {self.block_size}")
        _check(self.num_blocks is None or self.num_blocks >= 2, "memory.num_blocks",
               "must be at least 2 (block 0 is the null block)")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "memory.kv_cache_dtype",
               f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


POLICIES = ("fcfs", "priority", "fair")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits and policy."""

    max_num_seqs: int = _f(128, "most requests running in one step")
    max_num_batched_tokens: int = _f(2048, "token budget of one step (prefill chunks + decodes)")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps under the budget")
    max_step_ms: float | None = _f(None, "target time of one step: the engine core learns "
                                   "step times from the steps it runs and lowers a step's "
                                   "prefill tokens to fit beside its decodes (never under a "
                                   "block a step), bounding how long a new request waits "
                                   "for the step in flight; null: the token budget only")
    num_scheduler_steps: int = _f(4, "decode steps the worker runs back to back for one "
                                  "plan when every running request is a plain decode and "
                                  "nothing waits: the engine core and the API handle each "
                                  "request's tokens once per run of steps, not once per "
                                  "token (vLLM's multi-step scheduling); a newcomer waits "
                                  "for the run in flight. 1: one step per plan")
    max_run_ms: float | None = _f(100.0, "a run of decode steps is held to the steps the "
                                  "learned step cost predicts to fit within this many ms "
                                  "(one step until it is learned), so a newcomer waits "
                                  "at most about this long for the run in flight; with "
                                  "max_step_ms too the smaller holds; null: no bound")
    policy: str = _f("fcfs", "fcfs (arrival order), priority (lower priority value first) "
                     "or fair (tenants share slots and tokens by weight: deficit round "
                     "robin, weights per request from api.tenant_weights)")
    fair_step_factor: float = _f(2.0, "policy fair: while two or more tenants are "
                                 "active (requests live, or within 10 s of their last), "
                                 "every step is held to this many times the measured "
                                 "step of a short prompt alone (the step a newcomer's "
                                 "first token takes; with max_step_ms too the smaller "
                                 "holds), decodes taken round robin when they alone "
                                 "would exceed it, so another tenant's newcomer waits a "
                                 "short step, not a flood's; for 100 ms after a tenant's "
                                 "last request ended, one such step (its next request is "
                                 "likeliest then); chunked prefill on only; 0: off")
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
        _check(self.max_step_ms is None or self.max_step_ms > 0, "scheduler.max_step_ms",
               "must be positive (or null)")
        _check(self.num_scheduler_steps >= 1, "scheduler.num_scheduler_steps",
               "must be at least 1")
        _check(self.max_run_ms is None or self.max_run_ms > 0, "scheduler.max_run_ms",
               "must be positive (or null)")
        _check(self.fair_step_factor == 0 or self.fair_step_factor >= 1,
               "scheduler.fair_step_factor", "must be 0 (off) or at least 1")
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
PREFILL_ATTENTIONS = ("sdpa", "native", "amx")  # amx: native's older name
DECODE_V_PASSES = ("widened", "paired", "auto")
LINEAR_BACKENDS = ("auto", "native", "kernel", "widen", "int8", "int16", "bf16dot", "amx",
                   "mkldnn")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Where and how the model runs."""

    device: str = _f("auto", "auto|cpu|cuda (auto: cuda when available)")
    num_threads: int = _f(0, "CPU threads for torch; 0 keeps torch's default (all cores)")
    attention_backend: str = _f("auto", "auto (Triton kernels on CUDA; on a CPU the native "
                                "decode kernel when it builds, else torch), torch (the "
                                "reference everywhere) or triton (on a CPU only under "
                                "TRITON_INTERPRET=1, for tests)")
    prefill_attention: str = _f("sdpa", "CPU, native attention backend: sdpa (torch's own "
                                "attention for prompt segments, the numerics of HF's bf16 "
                                "path) or native (bf16 prompts whose keys are all this step's "
                                "through kernels/csrc/prefill_attention.cpp, on AMX tiles "
                                "where the CPU has them, else AVX512-BF16 dot products: "
                                "1.4-5.9x faster on AMX, closer to float32; without "
                                "AVX512-BF16 sdpa runs; amx: the older name of native). "
                                "README: 'AMX prefill attention'")
    decode_v_pass: str = _f("widened", "CPU, native attention backend, bf16 model and KV "
                            "cache: how the decode kernel weighs the value rows. widened "
                            "(float32 FMAs on float32 probabilities), paired (two keys a "
                            "lane with AVX512-BF16 vdpbf16ps, the probabilities rounded to "
                            "bf16: 1.1-1.2x attention on a Zen 4, greedy answers can "
                            "change) or auto (paired where it measures faster at start-up, "
                            "cached per machine; widened in deterministic mode). README: "
                            "'Decode V pass'")
    omp_spin_count: int | None = _f(3000, "CPU: GOMP_SPINCOUNT for the worker process, "
                                    "how long an OpenMP thread spins before it sleeps "
                                    "(libgomp's default, 300000, made a short request's first "
                                    "token 28x slower when any other busy process took one of "
                                    "two cores; 3000: 2.2x). null keeps libgomp's default; a "
                                    "GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment "
                                    "wins")
    enforce_eager: bool = _f(False, "CUDA: run every step eagerly; false captures decode "
                             "steps as CUDA graphs over a ladder of batch sizes (1, 2, 4, 8, "
                             "16, 32, ... up to scheduler.max_num_seqs, at most 512)")
    k_major_weights: bool = _f(True, "CPU: store float32 linear weights K-major ([in, out] "
                               "contiguous), 1.5-5x faster matmuls at 4-32 rows; a tied LM "
                               "head gets its own copy (vocab x hidden more memory). 16-bit "
                               "weights stay row-major where the native kernel reads them")
    linear_backend: str = _f("auto", "CPU linear layers: auto times every exact path "
                             "on the model's shapes at load and keeps the fastest per "
                             "shape and row count (cached per CPU); native|kernel|widen|"
                             "bf16dot|amx force one where it applies (bf16dot: Q4_0/Q4_1/"
                             "Q4_K/Q6_K weights, bf16 activations, AVX512-BF16; amx: the "
                             "same on AMX-BF16 tiles, Q8_0 too, and bf16 weights on AMX "
                             "tiles as stored (timed up to 64 rows); mkldnn: bf16 weights "
                             "through oneDNN on a copy reordered once at load, one more "
                             "copy of each weight that takes it); int8 (quantized "
                             "weights only: "
                             "activations quantized per block of 32, faster from a few "
                             "rows on, less accurate; auto never picks it) forces the "
                             "quantized kernels' integer route; int16 (Q4_0/Q4_1/Q4_K/"
                             "Q8_0, AVX2: activations rounded to int16 per block, 256x "
                             "finer than int8; auto times it) forces the 16-bit integer "
                             "route (see worker/models/linear_paths.py)")
    fused_decode: bool = _f(True, "CPU: decode-only steps run each decoder layer as one "
                            "native op (norms, projections, RoPE, cache write, attention, "
                            "MLP) instead of ~100 torch ops; same kernels and rounding. "
                            "Steps with prefill, LoRA, tensor parallelism, deterministic "
                            "mode or an fp8/int8 KV cache take the torch layers")
    huge_pages: bool = _f(True, "CPU: copy the weights of a model of 64 MiB and more into "
                          "one buffer on transparent huge pages (madvise) at load: decode "
                          "streams them with fewer TLB misses (worker/huge_pages.py)")
    enable_sleep_mode: bool = _f(False, "serve LLM.sleep/wake_up and POST /sleep, /wake_up, "
                                 "GET /is_sleeping (RL hooks: free the KV pool, level 2 "
                                 "the weights too, between generations)")
    enable_weight_updates: bool = _f(False, "serve POST /update_weights (a safetensors file "
                                     "or folder the worker can read; behind the API key)")
    extension_cls: str | None = _f(None, "'package.module:Class' whose public methods "
                                   "LLM.collective_rpc may call on the worker (constructed "
                                   "with the ModelRunner); null: none")
    deterministic: bool = _f(False, "CPU: batch-invariant kernels, so a request's tokens "
                             "and logprobs are the same bits whatever shares its batch, "
                             "however its prefill is chunked and whether its prefix came "
                             "from the cache (README, \"Deterministic mode\": its cost); "
                             "needs the native CPU kernels; refused with LoRA, speculative "
                             "decoding, tensor parallelism, CUDA, quantized weights and "
                             "the int8 KV cache")

    def __post_init__(self):
        _check(self.device in DEVICES, "worker.device",
               f"must be one of {DEVICES}, got {self.device!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "worker.attention_backend",
               f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _check(self.prefill_attention in PREFILL_ATTENTIONS, "worker.prefill_attention",
               f"must be one of {PREFILL_ATTENTIONS}, got {self.prefill_attention!r}")
        _check(self.decode_v_pass in DECODE_V_PASSES, "worker.decode_v_pass",
               f"must be one of {DECODE_V_PASSES}, got {self.decode_v_pass!r}")
        _check(self.num_threads >= 0, "worker.num_threads", "must be non-negative")
        _check(self.omp_spin_count is None or (
            isinstance(self.omp_spin_count, int) and self.omp_spin_count >= 0),
            "worker.omp_spin_count", "must be null or a non-negative integer")
        _check(self.linear_backend in LINEAR_BACKENDS, "worker.linear_backend",
               f"must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        _check(self.extension_cls is None or (
            isinstance(self.extension_cls, str) and self.extension_cls.count(":") == 1),
            "worker.extension_cls", f"must be 'package.module:Class', got "
            f"{self.extension_cls!r}")


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
                                   "http://localhost:4317 (grpc); null: OTEL_EXPORTER_OTLP_"
                                   "(TRACES_)ENDPOINT, else tracing off")
    otlp_protocol: str | None = _f(None, "http/protobuf or grpc; null: "
                                   "OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf")
    trace_sample_ratio: float | None = _f(None, "fraction of requests traced (a client's "
                                          "sampled traceparent is always followed); null: "
                                          "OTEL_TRACES_SAMPLER/_ARG, else every request")
    trace_step_detail: str = _f("step", "per-request engine spans: 'step' (one per engine "
                                "step; +1.1% CPU with every request traced) or 'phase' (one "
                                "for prefill, one for decode; +0.4%), measured by "
                                "benchmarks/tracing_overhead.py")
    enable_metrics: bool = _f(True, "serve Prometheus metrics at the API's /metrics")
    metrics_prefix: str = _f("folio", "engine metric names start '<prefix>:' ('vllm' for "
                             "dashboards made for vLLM)")

    def __post_init__(self):
        _check(self.metrics_prefix.isidentifier(), "observability.metrics_prefix",
               "must be a name of letters, digits and underscores")
        _check(self.log_level in LOG_LEVELS, "observability.log_level",
               f"must be one of {LOG_LEVELS}")
        _check(self.log_format in LOG_FORMATS, "observability.log_format",
               f"must be one of {LOG_FORMATS}")
        _check(self.otlp_protocol in (None, *OTLP_PROTOCOLS),
               "observability.otlp_protocol",
               f"must be one of {OTLP_PROTOCOLS}")
        _check(self.trace_sample_ratio is None or 0.0 <= self.trace_sample_ratio <= 1.0,
               "observability.trace_sample_ratio",
               "must be in [0, 1]")
        _check(self.trace_step_detail in TRACE_STEP_DETAILS, "observability.trace_step_detail",
               f"must be one of {TRACE_STEP_DETAILS}")


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
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        # each replica listens on its own unix socket; one host:port cannot name several
        for key in ("engine_core_address", "worker_address"):
            _check(self.parallel.data_parallel_size == 1
                   or getattr(self.services, key) is None, f"services.{key}",
                   "data_parallel_size > 1 needs unix sockets (services.socket_dir): one "
                   "address cannot name every replica")
        check_deterministic_supported(self)
