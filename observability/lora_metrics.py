"""The LoRA part of the engine's Prometheus metrics.

``folio:lora_requests_info`` is vLLM's ``vllm:lora_requests_info``: one series whose
labels name the adapters of running and of waiting requests (comma-separated, sorted)
and ``max_lora``; its value is the time of the update. Only the current series is
kept (an old label set is removed when the adapters change), so a scrape shows what
runs now. The loaded-adapter gauge and the load/eviction/failure counters come from
the engine core's registry (engine_core/lora_registry.py).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine_core.lora_control import LoRAStats

PREFIX = "folio:"


class LoRAMetrics:
    """lora_requests_info, num_lora_adapters_loaded and the load/eviction counters."""

    def __init__(self, registry: CollectorRegistry, max_loras: int, prefix: str = PREFIX):
        self.max_loras = str(max_loras)
        self.info = Gauge(prefix + "lora_requests_info", "Running and waiting LoRA adapters "
                          "(labels), updated at (value, unix time)",
                          ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                          registry=registry)
        self.num_loaded = Gauge(prefix + "num_lora_adapters_loaded",
                                "LoRA adapters held in the worker's host cache",
                                registry=registry)
        self.loads = Counter(prefix + "lora_loads", "LoRA adapter loads", registry=registry)
        self.evictions = Counter(prefix + "lora_evictions", "LoRA adapter evictions",
                                 registry=registry)
        self.failures = Counter(prefix + "lora_load_failures", "LoRA adapter loads that "
                                "failed", registry=registry)
        self._labels: tuple[str, str, str] | None = None
        self._last = (0, 0, 0)

    def update(self, stats: LoRAStats) -> None:
        labels = (",".join(stats.running), ",".join(stats.waiting), self.max_loras)
        if labels != self._labels:
            self.info.clear()
            self._labels = labels
        self.info.labels(*labels).set(time.time())
        self.num_loaded.set(stats.num_loaded)
        counts = (stats.num_loads, stats.num_evictions, stats.num_load_failures)
        for counter, now, before in zip((self.loads, self.evictions, self.failures),
                                        counts, self._last):
            counter.inc(now - before)
        self._last = counts
