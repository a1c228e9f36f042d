"""Which config keys a running stack can take live, and the diff of two configs.

A reload (README, "Live retune") compares the new file's config with the running one
key by key. Every changed key must be in LIVE_KEYS and pass its ceiling, or the whole
reload is refused (all-or-nothing): the stack keeps the old config entirely and the
error names each refused key. A key is live when every process that reads it can swap
it between two uses without a restart:

- scheduler limits are read by the engine core at every step and every add;
- api limits and keys are read per request (or per connection) by each API process;
- log level, trace sample ratio and trace step detail are set in every process;
- ``lora.adapters`` becomes loads and unloads in the engine core, as the runtime
  endpoints make them (services/engine_core_service/adapter_retune.py), when LoRA was
  on from start-up.

Everything else (the model, dtypes, the KV pool and block size, devices, sockets,
processes, the scheduling policy, listener settings, LoRA slots,
speculative method) shapes memory or processes made at start-up: restart-only.

Ceilings: on a CUDA worker the step size was profiled (activation memory, CUDA graphs)
at the start-up ``max_num_seqs`` and ``max_num_batched_tokens``, so those may be lowered
live and raised back only up to their start-up values; the same holds everywhere for
``speculative.num_speculative_tokens`` (per-position metrics are sized at start-up).
With chunked prefill off a prompt must fit one step, so ``max_num_batched_tokens`` is
then restart-only (lowering it could strand a long prompt already admitted).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from config.loader import config_from_plain
from config.schema import FolioConfig

SCHEDULER_LIVE = ("max_num_seqs", "max_num_batched_tokens", "max_num_queued_requests",
                  "max_num_queued_tokens", "max_step_ms", "num_scheduler_steps",
                  "max_run_ms", "fair_step_factor")
OBSERVABILITY_LIVE = ("log_level", "trace_sample_ratio", "trace_step_detail")
API_LIVE = ("api_keys", "public_metrics", "public_health_detail", "public_poll_interval_s",
            "max_n", "max_batch_prompts", "max_stop_strings", "max_logprobs", "tenant_weights",
            "header_timeout_s", "body_timeout_s", "max_connections",
            "max_buffered_body_bytes", "max_stop_string_chars", "max_stop_token_ids",
            "tenant_body_bytes_per_s", "tenant_body_burst_bytes",
            "tenant_body_max_wait_s", "max_json_values",
            "max_grammar_chars", "grammar_compile_timeout_s")
SPECULATIVE_LIVE = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "disable_by_batch_size", "enable_adaptive")

LIVE_KEYS: frozenset[str] = frozenset(
    [f"scheduler.{k}" for k in SCHEDULER_LIVE]
    + [f"observability.{k}" for k in OBSERVABILITY_LIVE]
    + [f"api.{k}" for k in API_LIVE]
    + [f"speculative.{k}" for k in SPECULATIVE_LIVE]
    + ["lora.adapters"])


@dataclass(frozen=True, slots=True)
class Refusal:
    """One changed key a running stack cannot take, and why."""

    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ConfigDiff:
    """The keys that differ between the running config and a new one."""

    changed: tuple[str, ...]
    refusals: tuple[Refusal, ...]

    @property
    def is_applicable(self) -> bool:
        return not self.refusals

    @property
    def refused_keys(self) -> list[str]:
        return [r.key for r in self.refusals]


def flat_items(config: FolioConfig) -> dict[str, Any]:
    """``section.key`` → value for every key of the tree."""
    return {f"{section.name}.{f.name}": getattr(getattr(config, section.name), f.name)
            for section in dataclasses.fields(config)
            for f in dataclasses.fields(getattr(config, section.name))}


def changed_keys(old: FolioConfig, new: FolioConfig) -> list[str]:
    """The dotted keys whose values differ, in the tree's order."""
    before, after = flat_items(old), flat_items(new)
    return [key for key in before if before[key] != after[key]]


def diff_configs(running: FolioConfig, new: FolioConfig, startup: FolioConfig,
                 is_cuda: bool = False) -> ConfigDiff:
    """Classify every changed key: live, or refused with its reason. ``startup`` is the
    config the stack started with (the ceilings above are its values)."""
    changed = changed_keys(running, new)
    refusals = []
    for key in changed:
        if key not in LIVE_KEYS:
            refusals.append(Refusal(key, "restart-only (changes what was built at "
                                         "start-up); restart the stack to change it"))
    if "lora.adapters" in changed and not running.lora.enable_lora:
        refusals.append(Refusal("lora.adapters", "needs lora.enable_lora: true from "
                                "start-up (the worker has no adapter slots)"))
    sched, first = new.scheduler, startup.scheduler
    if "scheduler.max_num_batched_tokens" in changed and not sched.enable_chunked_prefill:
        refusals.append(Refusal("scheduler.max_num_batched_tokens", "restart-only while "
                                "scheduler.enable_chunked_prefill is false (an admitted "
                                "prompt must keep fitting one step)"))
    ceilings = [("speculative.num_speculative_tokens", new.speculative.num_speculative_tokens,
                 startup.speculative.num_speculative_tokens, "")]
    if is_cuda:
        reason = " on a CUDA worker (its step memory was profiled for it)"
        ceilings += [("scheduler.max_num_seqs", sched.max_num_seqs, first.max_num_seqs,
                      reason),
                     ("scheduler.max_num_batched_tokens", sched.max_num_batched_tokens,
                      first.max_num_batched_tokens, reason)]
    for key, value, limit, why in ceilings:
        if key in changed and value > limit:
            refusals.append(Refusal(key, f"may be raised live only up to its start-up "
                                         f"value {limit}{why}, got {value}"))
    first_per_key = {}
    for refusal in refusals:
        first_per_key.setdefault(refusal.key, refusal)
    return ConfigDiff(tuple(changed), tuple(first_per_key.values()))


def config_to_json(config: FolioConfig) -> str:
    """The whole tree as JSON, secrets included (for the services' own links only)."""
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str, source: str = "the engine core") -> FolioConfig:
    """The inverse of ``config_to_json``, checked like a YAML file."""
    return config_from_plain(json.loads(text), source)
