"""Prometheus metrics of the engine, kept by the engine core and served by every API
process at /metrics (the API asks the engine core for the text), so that with several
API processes each scrape still sees one consistent, engine-wide set of numbers.

Names and meanings follow what vLLM operators chart, under the ``folio:`` prefix.
Request latencies are measured from the moment the API process accepted the request
(its wall clock travels in AddRequest); a request is one sample (``n > 1`` counts each
sample), except ``request_params_n`` and ``request_params_max_tokens``, observed once
per API request when the engine core admits it. With speculative decoding on, vLLM's
``spec_decode_*`` counters are served too.

``iteration_tokens_total`` is vLLM's: per engine step that produced tokens, the prompt
tokens of the requests whose first token came out in it plus the tokens generated in
it. A request of P prompt tokens and G output tokens thus adds P + G to the sum (the
last sampled token counts, though it is never fed back), where the tokens the model
computed are P + G - 1: ``iteration_scheduled_tokens`` histograms those per step (the
batch the worker ran).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine_core.engine import EngineCoreStats
from engine_core.outputs import EngineCoreOutput
from engine_core.scheduler_output import SchedulerOutput
from observability.lora_metrics import LoRAMetrics
from engine_core.spec.speculator import SpecDecodeStats
from engine_core.structured_outputs import StructuredOutputReport

PREFIX = "folio:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)


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
    """Every engine-side metric; ``render()`` gives the Prometheus text.

    ``max_loras`` (LoRA on) adds vLLM's ``lora_requests_info`` and the adapter counts
    (lora_metrics.py); ``num_spec_positions`` is speculative decoding's k (0: off, no
    spec_decode metrics); ``prefix`` is ``observability.metrics_prefix`` ("vllm" for
    vLLM's dashboards).
    """

    def __init__(self, model_name: str, *, max_loras: int | None = None,
                 num_spec_positions: int = 0, prefix: str = PREFIX.rstrip(":"),
                 cache_info: dict[str, str] | None = None):
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
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Per engine step with output: prompt tokens of requests "
            "whose first token came out plus tokens generated (vLLM's definition)",
            _TOKEN_BUCKETS)
        self.iteration_scheduled = histogram(
            "iteration_scheduled_tokens", "Tokens the model computed per engine step",
            _TOKEN_BUCKETS)
        self.params_n = histogram("request_params_n", "The n of each request",
                                  (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "The max_tokens of each request", _TOKEN_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "First schedule to finish (time running)",
                                        _LATENCY_BUCKETS)
        if cache_info is not None:  # vLLM's config gauge: the labels are the information
            Gauge(name_prefix + "cache_config_info", "The KV cache's configuration",
                  names + sorted(cache_info), registry=r).labels(**labels, **cache_info).set(1)
        self._step_tokens = 0  # this step's prompt (first tokens) + generated tokens
        self.lora = (LoRAMetrics(r, max_loras, name_prefix) if max_loras is not None
                     else None)
        self.grammar_compile = histogram(
            "structured_output_compile_seconds", "Grammar compiles in the worker (cache "
            "misses), each off the step loop", _COMPILE_BUCKETS)
        self.grammar_cache_hits = counter(
            "structured_output_cache_hits", "Constrained samples whose grammar was compiled "
            "already")
        self.grammar_deferrals = counter(
            "structured_output_deferrals", "Steps a constrained sample waited for its grammar")
        self._clocks: dict[str, _RequestClock] = {}
        self._last_queries = 0
        self._last_hits = 0
        self.spec = _SpecDecodeMetrics(r, labels, num_spec_positions, name_prefix) \
            if num_spec_positions else None

    def on_add(self, req_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._clocks[req_id] = _RequestClock(arrival_time, num_prompt_tokens, time.time())

    def on_request(self, n: int, max_tokens: int | None) -> None:
        """One API request admitted (its ``n`` samples each get an ``on_add``)."""
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)

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
            self.iteration_scheduled.observe(so.total_num_scheduled_tokens)
        self._step_tokens = 0
        for out in outputs:
            self._on_output(out, now)
        if self._step_tokens:
            self.iteration_tokens.observe(self._step_tokens)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - self._last_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - self._last_hits)
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if self.lora is not None and stats.lora is not None:
            self.lora.update(stats.lora)
        if self.spec is not None and stats.spec_decode is not None:
            self.spec.update(stats.spec_decode)

    def on_structured_output(self, report: StructuredOutputReport | None) -> None:
        """Account what the worker's grammars did in one step."""
        if report is None:
            return
        for seconds in report.compile_seconds:
            self.grammar_compile.observe(seconds)
        self.grammar_cache_hits.inc(report.num_cache_hits)
        self.grammar_deferrals.inc(len(report.deferred_req_ids))

    def _on_output(self, out: EngineCoreOutput, now: float) -> None:
        clock = self._clocks.get(out.req_id)
        if clock is None:
            return
        n = len(out.new_token_ids)
        if n:
            self.generation_tokens.inc(n)
            self._step_tokens += n
            if clock.first_token is None:
                self._step_tokens += clock.num_prompt_tokens
                clock.first_token = now
                self.ttft.observe(max(0.0, now - clock.arrival))
                if clock.first_scheduled is not None:
                    self.prefill_time.observe(now - clock.first_scheduled)
            elif clock.last_token is not None:
                # one observation per token, so the count is the tokens after the first
                # whether they came one per step or several (a run of decode steps,
                # speculative decoding) and the sum is the time they took
                gap = (now - clock.last_token) / n
                for _ in range(n):
                    self.itl.observe(gap)
            clock.last_token = now
            clock.num_generation_tokens += n
        if out.finished:
            del self._clocks[out.req_id]
            self._success.labels(finished_reason=str(out.finish_reason), **self._labels).inc()
            self.e2e.observe(max(0.0, now - clock.arrival))
            if clock.first_token is not None:
                self.decode_time.observe(now - clock.first_token)
            if clock.first_scheduled is not None:
                self.inference_time.observe(now - clock.first_scheduled)
            self.prompt_len.observe(clock.num_prompt_tokens)
            self.generation_len.observe(clock.num_generation_tokens)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _SpecDecodeMetrics:
    """vLLM's speculative-decoding counters, moved by the deltas of the engine's
    cumulative SpecDecodeStats."""

    def __init__(self, registry: CollectorRegistry, labels: dict, num_positions: int,
                 prefix: str = PREFIX):
        names = list(labels)

        def counter(name, doc):
            return Counter(prefix + name, doc, names, registry=registry).labels(**labels)

        self.num_drafts = counter("spec_decode_num_drafts",
                                  "Requests' draft runs verified (one per request per step)")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted")
        per_pos = Counter(prefix + "spec_decode_num_accepted_tokens_per_pos",
                          "Draft tokens accepted at each position of a draft run",
                          names + ["position"], registry=registry)
        self.per_pos = [per_pos.labels(position=str(i), **labels)
                        for i in range(num_positions)]
        self._last = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * num_positions)

    def update(self, stats: SpecDecodeStats) -> None:
        last = self._last
        self.num_drafts.inc(stats.num_drafts - last.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens - last.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        for counter, now, before in zip(self.per_pos, stats.num_accepted_tokens_per_pos,
                                        last.num_accepted_tokens_per_pos):
            counter.inc(now - before)
        self._last = stats
