"""Prometheus metrics of the engine, kept by the engine core and served by every API
process at /metrics (the API asks the engine core for the text), so that with several
API processes each scrape still sees one consistent, engine-wide set of numbers.

Names follow what vLLM operators chart, under the ``folio:`` prefix. Request latencies
are measured from the moment the API process accepted the request (its wall clock
travels in AddRequest); a request is one sample (``n > 1`` counts each sample).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine_core.engine import EngineCoreStats
from engine_core.outputs import EngineCoreOutput
from engine_core.scheduler_output import SchedulerOutput

PREFIX = "folio:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


@dataclass(slots=True)
class _RequestClock:
    arrival: float  # wall clock at the API
    num_prompt_tokens: int
    queued: float  # wall clock at the engine core (again after a preemption)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0


class EngineMetrics:
    """Every engine-side metric; ``render()`` gives the Prometheus text."""

    def __init__(self, model_name: str, prefix: str = PREFIX.rstrip(":")):
        self.registry = CollectorRegistry()
        name_prefix = prefix + ":"  # observability.metrics_prefix: "vllm" for vLLM's dashboards
        labels = {"model_name": model_name}
        self._labels = labels
        r = self.registry
        names = ["model_name"]

        def gauge(name, doc):
            return Gauge(name_prefix + name, doc, names, registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(name_prefix + name, doc, names, registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name_prefix + name, doc, names, buckets=buckets,
                             registry=r).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests queued")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage (1 = full)")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache")
        self.num_preemptions = counter("num_preemptions", "Preemptions (by recompute)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self._success = Counter(name_prefix + "request_success", "Finished requests by reason",
                                names + ["finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting to be "
                                    "scheduled (first admission)", _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First schedule to first token", _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First token to finish", _LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length", _TOKEN_BUCKETS)
        self.generation_len = histogram("request_generation_tokens", "Output length",
                                        _TOKEN_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step",
                                          _TOKEN_BUCKETS)
        self._clocks: dict[str, _RequestClock] = {}
        self._last_queries = 0
        self._last_hits = 0

    def on_add(self, req_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._clocks[req_id] = _RequestClock(arrival_time, num_prompt_tokens, time.time())

    def on_step(self, so: SchedulerOutput, outputs: list[EngineCoreOutput],
                stats: EngineCoreStats) -> None:
        """Account one finished step: admissions, preemptions, tokens, finishes."""
        now = time.time()
        for new in so.scheduled_new_reqs:
            clock = self._clocks.get(new.req_id)
            if clock is not None and clock.first_scheduled is None:
                clock.first_scheduled = now
                self.queue_time.observe(max(0.0, now - clock.queued))
                self.prompt_tokens.inc(clock.num_prompt_tokens)
        for req_id in so.preempted_req_ids:
            self.num_preemptions.inc()
        if so.total_num_scheduled_tokens:
            self.iteration_tokens.observe(so.total_num_scheduled_tokens)
        for out in outputs:
            self._on_output(out, now)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - self._last_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - self._last_hits)
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits

    def _on_output(self, out: EngineCoreOutput, now: float) -> None:
        clock = self._clocks.get(out.req_id)
        if clock is None:
            return
        n = len(out.new_token_ids)
        if n:
            self.generation_tokens.inc(n)
            if clock.first_token is None:
                clock.first_token = now
                self.ttft.observe(max(0.0, now - clock.arrival))
                if clock.first_scheduled is not None:
                    self.prefill_time.observe(now - clock.first_scheduled)
            elif clock.last_token is not None:
                self.itl.observe((now - clock.last_token) / n)
            clock.last_token = now
            clock.num_generation_tokens += n
        if out.finished:
            del self._clocks[out.req_id]
            self._success.labels(finished_reason=str(out.finish_reason), **self._labels).inc()
            self.e2e.observe(max(0.0, now - clock.arrival))
            if clock.first_token is not None:
                self.decode_time.observe(now - clock.first_token)
            self.prompt_len.observe(clock.num_prompt_tokens)
            self.generation_len.observe(clock.num_generation_tokens)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
