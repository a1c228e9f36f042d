"""YAML → FolioConfig, with command-line and environment overrides.

Precedence, lowest first: schema defaults, the YAML file, ``FOLIO_<SECTION>__<KEY>``
environment variables, ``--set section.key=value`` overrides, keyword overrides from
the offline API. Every key is checked against the schema: an unknown key or a value
of the wrong type is a ConfigError naming the key and the file it came from.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from config.schema import ConfigError, FolioConfig

DEFAULT_CONFIG_PATH = Path(__file__).with_name("default.yaml")
ENV_PREFIX = "FOLIO_"

# vLLM's flat engine-argument names, mapped onto our sections.
FLAT_ALIASES = {
    "model": "model.path",
    "dtype": "model.dtype",
    "quantization": "model.quantization",
    "max_model_len": "model.max_model_len",
    "tokenizer": "model.tokenizer",
    "seed": "model.seed",
    "kv_cache_memory_bytes": "memory.kv_cache_bytes",
    "kv_cache_bytes": "memory.kv_cache_bytes",
    "gpu_memory_utilization": "memory.gpu_memory_utilization",
    "block_size": "memory.block_size",
    "num_gpu_blocks_override": "memory.num_blocks",
    "num_blocks": "memory.num_blocks",
    "kv_cache_dtype": "memory.kv_cache_dtype",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "scheduling_policy": "scheduler.policy",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "prefix_caching_hash_algo": "cache.hash_algorithm",
    "device": "worker.device",
    "num_threads": "worker.num_threads",
    "enforce_eager": "worker.enforce_eager",
    "attention_backend": "worker.attention_backend",
    "enable_sleep_mode": "worker.enable_sleep_mode",
    "worker_extension_cls": "worker.extension_cls",
    "enable_lora": "lora.enable_lora",
    "max_loras": "lora.max_loras",
    "max_lora_rank": "lora.max_lora_rank",
    "max_cpu_loras": "lora.max_cpu_loras",
    "speculative_method": "speculative.method",
    "num_speculative_tokens": "speculative.num_speculative_tokens",
    "prompt_lookup_min": "speculative.prompt_lookup_min",
    "prompt_lookup_max": "speculative.prompt_lookup_max",
    "speculative_draft_model": "speculative.draft_model",
    "speculative_disable_by_batch_size": "speculative.disable_by_batch_size",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "distributed_backend": "parallel.distributed_backend",
    "data_parallel_size": "parallel.data_parallel_size",
}


def _section_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against annotation ``tp``; accept ints for floats only."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is tuple:  # tuple[str, ...]: a YAML list, or "a,b" from env or --set
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r} (in {source})", key)
        return tuple(_coerce(v, typing.get_args(tp)[0], key, source) for v in value)
    if origin is dict:  # dict[str, float]: a YAML mapping, or "a=1,b=2" from env or --set
        if isinstance(value, str):
            pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
            if not all(len(p) == 2 for p in pairs):
                raise ConfigError(f"{key}: expected key=value pairs, got {value!r} "
                                  f"(in {source})", key)
            value = {k.strip(): _parse_scalar(v.strip()) for k, v in pairs}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r} (in {source})", key)
        key_type, value_type = typing.get_args(tp)
        return {_coerce(k, key_type, key, source): _coerce(v, value_type, key, source)
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _coerce_item(value, tp, key, source)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[tp](value)
    if not ok:
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r} (in {source})", key)
    return float(value) if tp is float else value


def _coerce_item(value: Any, cls: type, key: str, source: str) -> Any:
    """One list item that is a small dataclass (lora.adapters): a YAML mapping of its
    fields, or the ``name=path`` text its ``parse`` reads (from env or --set)."""
    hints = _section_types(cls)
    if isinstance(value, str) and hasattr(cls, "parse"):
        def build():
            return cls.parse(value)
    elif isinstance(value, dict) and set(value) <= set(hints):
        fields = {k: _coerce(v, hints[k], key, source) for k, v in value.items()}

        def build():
            return cls(**fields)
    else:
        raise ConfigError(f"{key}: expected a mapping with keys {', '.join(hints)}, got "
                          f"{value!r} (in {source})", key)
    try:  # the item's own checks name the key; the source is added here
        return build()
    except ConfigError as e:
        raise ConfigError(f"{e} (in {source})", e.key) from None


def _set_path(tree: dict, dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{dotted}: expected 'section.key' (in {source})", dotted)
    tree.setdefault(parts[0], {})
    if not isinstance(tree[parts[0]], dict):
        raise ConfigError(f"{parts[0]}: must be a mapping (in {source})", parts[0])
    tree[parts[0]][parts[1]] = (value, source)


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would (``64`` → int, ``null`` → None)."""
    return yaml.safe_load(text) if text != "" else ""


def parse_set_overrides(items: list[str]) -> dict[str, Any]:
    """``["scheduler.max_num_seqs=64"]`` → ``{"scheduler.max_num_seqs": 64}``."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.key=value", item)
        out[key.strip()] = _parse_scalar(raw.strip())
    return out


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``FOLIO_SCHEDULER__MAX_NUM_SEQS=64`` → ``{"scheduler.max_num_seqs": 64}``."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, raw in environ.items():
        if name.startswith(ENV_PREFIX) and "__" in name:
            section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
            out[f"{section}.{key}"] = _parse_scalar(raw)
    return out


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _build(tree: dict[str, dict[str, tuple[Any, str]]]) -> FolioConfig:
    sections = {}
    top = _section_types(FolioConfig)
    for section, entries in tree.items():
        if section not in top:
            srcs = {src for _, src in entries.values()} if isinstance(entries, dict) else set()
            raise ConfigError(f"{section}: unknown section (in {', '.join(sorted(srcs))}); "
                              f"known: {', '.join(top)}", section)
        cls = top[section]
        hints = _section_types(cls)
        kwargs = {}
        for key, (value, source) in entries.items():
            dotted = f"{section}.{key}"
            if key not in hints:
                raise ConfigError(f"{dotted}: unknown key (in {source}); known keys of "
                                  f"{section}: {', '.join(hints)}", dotted)
            kwargs[key] = _coerce(value, hints[key], dotted, source)
        try:
            sections[section] = cls(**kwargs)
        except ConfigError as e:
            sources = sorted({src for _, src in entries.values()})
            raise ConfigError(f"{e} (in {', '.join(sources)})", e.key) from None
    try:  # checks across sections
        return FolioConfig(**sections)
    except ConfigError as e:
        sources = sorted({src for entries in tree.values() if isinstance(entries, dict)
                          for _, src in entries.values()})
        raise ConfigError(f"{e} (in {', '.join(sources)})", e.key) from None


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                *, use_env: bool = True) -> FolioConfig:
    """Build the config tree from ``path`` (default: config/default.yaml) and overrides.

    ``overrides`` keys are ``section.key`` or one of vLLM's flat names in FLAT_ALIASES.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    tree = _tree_of(_read_yaml(path), str(path))
    layers = [(env_overrides() if use_env else {}, "environment"),
              (dict(overrides or {}), "overrides")]
    for layer, source in layers:
        for key, value in layer.items():
            _set_path(tree, FLAT_ALIASES.get(key, key), value, source)
    return _build(tree)


def _tree_of(data: dict, source: str) -> dict[str, dict]:
    tree: dict[str, dict] = {}
    for section, entries in data.items():
        if not isinstance(entries, dict):
            raise ConfigError(f"{section}: must be a mapping of keys (in {source})", section)
        for key, value in entries.items():
            _set_path(tree, f"{section}.{key}", value, source)
    return tree


def config_from_plain(data: dict, source: str) -> FolioConfig:
    """The config tree from plain data (``dataclasses.asdict`` of one, as it crosses a
    socket), checked like a YAML file named ``source``; no environment or overrides."""
    return _build(_tree_of(data, source))


def config_to_dict(config: FolioConfig) -> dict:
    """The resolved tree as plain data (for logging at start-up); secrets redacted."""
    tree = dataclasses.asdict(config)
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(getattr(config, section.name)):
            if f.metadata.get("secret"):
                tree[section.name][f.name] = "<redacted>"
    return tree
