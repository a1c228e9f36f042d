"""The live-retune diff: which changed keys a running stack takes, which it refuses and
why, and the JSON round trip the running config makes between the services."""
import dataclasses

import pytest

from config.live_config import (LIVE_KEYS, changed_keys, config_from_json, config_to_json,
                                diff_configs, flat_items)
from config.lora import LoRAAdapterConfig
from config.schema import ConfigError, FolioConfig
from services.api.admin_routes import take_live_keys


def edit(config: FolioConfig, **sections) -> FolioConfig:
    """``config`` with ``section={key: value}`` edits."""
    return dataclasses.replace(config, **{
        name: dataclasses.replace(getattr(config, name), **values)
        for name, values in sections.items()})


BASE = FolioConfig()


def test_no_change_is_empty_and_applicable():
    diff = diff_configs(BASE, FolioConfig(), BASE)
    assert diff.changed == () and diff.is_applicable


def test_live_keys_are_applied_and_listed_in_tree_order():
    new = edit(BASE, scheduler={"max_num_seqs": 4, "max_num_queued_requests": 3},
               observability={"trace_sample_ratio": 0.0, "log_level": "debug"},
               api={"api_keys": ("k1",), "max_n": 2})
    diff = diff_configs(BASE, new, BASE)
    assert diff.is_applicable
    assert diff.changed == ("scheduler.max_num_seqs", "scheduler.max_num_queued_requests",
                            "observability.log_level", "observability.trace_sample_ratio",
                            "api.api_keys", "api.max_n")


@pytest.mark.parametrize("section,key,value", [
    ("model", "path", "other.gguf"), ("model", "dtype", "bfloat16"),
    ("memory", "block_size", 32), ("memory", "kv_cache_bytes", 1024),
    ("worker", "device", "cpu"), ("worker", "deterministic", True), ("services", "socket_dir", "/tmp/x"),
    ("services", "api_port", 9000), ("scheduler", "policy", "fair"),
    ("scheduler", "enable_chunked_prefill", False), ("cache", "enable_prefix_caching", False),
    ("api", "max_body_bytes", 8192), ("api", "num_tokenizer_threads", 4),
    ("observability", "otlp_endpoint", "http://x:4318"),
    ("lora", "max_loras", 2), ("speculative", "method", "ngram"),
])
def test_restart_only_keys_are_refused_by_name(section, key, value):
    edits = {"scheduler": {"max_num_seqs": 3}}  # a live change alongside
    edits.setdefault(section, {})[key] = value
    new = edit(BASE, **edits)
    diff = diff_configs(BASE, new, BASE)
    assert not diff.is_applicable
    assert diff.refused_keys == [f"{section}.{key}"]  # the live one alongside is not refused
    assert "restart" in str(diff.refusals[0])


def test_every_refused_key_is_named_all_or_nothing():
    new = edit(BASE, model={"dtype": "float16"}, memory={"block_size": 8},
               scheduler={"max_num_seqs": 2})
    diff = diff_configs(BASE, new, BASE)
    assert diff.refused_keys == ["model.dtype", "memory.block_size"]
    assert "scheduler.max_num_seqs" in diff.changed


def test_token_budget_is_restart_only_without_chunked_prefill():
    start = edit(BASE, scheduler={"enable_chunked_prefill": False})
    diff = diff_configs(start, edit(start, scheduler={"max_num_batched_tokens": 512}), start)
    assert diff.refused_keys == ["scheduler.max_num_batched_tokens"]
    assert "enable_chunked_prefill" in diff.refusals[0].reason


def test_cuda_ceilings_are_the_start_up_values():
    lowered = edit(BASE, scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 256})
    assert diff_configs(BASE, lowered, BASE, is_cuda=True).is_applicable
    back = diff_configs(lowered, BASE, BASE, is_cuda=True)  # back up to start-up: fine
    assert back.is_applicable
    over = edit(BASE, scheduler={"max_num_seqs": 256})
    diff = diff_configs(BASE, over, BASE, is_cuda=True)
    assert diff.refused_keys == ["scheduler.max_num_seqs"] and "128" in diff.refusals[0].reason
    assert diff_configs(BASE, over, BASE, is_cuda=False).is_applicable  # a CPU: no ceiling


def test_the_adapter_list_is_live_where_lora_was_on_from_start_up():
    start = edit(BASE, lora={"enable_lora": True})
    more = edit(start, lora={"adapters": (LoRAAdapterConfig("a", "/p"),)})
    diff = diff_configs(start, more, start)
    assert diff.is_applicable and diff.changed == ("lora.adapters",)
    off = diff_configs(BASE, edit(BASE, lora={"adapters": (LoRAAdapterConfig("a", "/p"),)}),
                       BASE)
    assert off.refused_keys == ["lora.adapters"] and "enable_lora" in off.refusals[0].reason
    both = diff_configs(BASE, edit(more, lora={"max_loras": 2}), BASE)  # turned on with it
    assert set(both.refused_keys) == {"lora.enable_lora", "lora.max_loras", "lora.adapters"}


def test_speculative_tokens_may_not_grow_past_start_up():
    start = edit(BASE, speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert diff_configs(start, edit(start, speculative={"num_speculative_tokens": 2}),
                        start).is_applicable
    diff = diff_configs(start, edit(start, speculative={"num_speculative_tokens": 6}), start)
    assert diff.refused_keys == ["speculative.num_speculative_tokens"]


def test_live_keys_all_exist_in_the_tree():
    assert LIVE_KEYS <= set(flat_items(BASE))


def test_json_round_trip_keeps_every_key_and_secret():
    config = edit(BASE, api={"api_keys": ("secret-1",), "tenant_weights": {"t": 2.0}},
                  lora={"enable_lora": True, "adapters": (LoRAAdapterConfig("a", "/p"),)})
    back = config_from_json(config_to_json(config))
    assert back == config and changed_keys(config, back) == []


def test_an_api_process_takes_only_live_keys_from_a_pushed_config():
    own = BASE
    pushed = edit(BASE, api={"max_n": 3, "max_buffered_body_bytes": 2 ** 23,
                             "max_body_bytes": 2 ** 23},
                  model={"served_model_name": "other"}, observability={"log_level": "error"},
                  scheduler={"max_num_seqs": 5, "policy": "fair"})
    taken = take_live_keys(own, pushed)
    assert taken.api.max_n == 3 and taken.api.max_buffered_body_bytes == 2 ** 23
    assert taken.api.max_body_bytes == own.api.max_body_bytes  # restart-only: kept
    assert taken.model == own.model and taken.observability.log_level == "error"
    assert taken.scheduler.max_num_seqs == 5 and taken.scheduler.policy == "fcfs"
    # live values that only fit the pushed restart-only ones are refused, not half-taken
    small = edit(BASE, api={"max_body_bytes": 2048, "max_buffered_body_bytes": 2048,
                            "tenant_body_burst_bytes": 2048})
    with pytest.raises(ConfigError, match="api.max_buffered_body_bytes"):
        take_live_keys(own, small)
