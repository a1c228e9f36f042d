"""Everything the engine core reports about requests and steps: Prometheus metrics,
OpenTelemetry spans (engine_tracer.py) and request log lines, fed from the
step loop at three points (add, step begin, step end) so the loop stays readable."""
from __future__ import annotations

from dataclasses import dataclass

from config.schema import FolioConfig
from engine_core.engine import EngineCore
from engine_core.model_facts import ModelFacts
from engine_core.outputs import EngineCoreOutput, ModelRunnerOutput
from engine_core.scheduler_output import SchedulerOutput
from observability.logging import get_logger
from observability.metrics import EngineMetrics
from observability.tracing import Tracing, parse_traceparent
from services.engine_core_service.engine_tracer import EngineTracer
from services.protocol import AddRequest

log = get_logger("services.engine_core")


def cache_config_info(config: FolioConfig, facts: ModelFacts) -> dict[str, str]:
    """The labels of vLLM's ``cache_config_info`` gauge (vLLM's label names where Folio
    has the same setting; ``num_gpu_blocks`` counts the KV pool on any device)."""
    memory, cache = config.memory, config.cache
    return {"block_size": str(facts.block_size), "num_gpu_blocks": str(facts.num_blocks),
            "num_gpu_blocks_override": str(memory.num_blocks),
            "cache_dtype": (facts.dtype if memory.kv_cache_dtype == "auto"
                            else memory.kv_cache_dtype), "device": facts.device,
            "gpu_memory_utilization": str(memory.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(memory.kv_cache_bytes),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "prefix_caching_hash_algo": cache.hash_algorithm}


@dataclass(slots=True)
class _RequestIds:
    request_id: str  # the API's id (the parent of n > 1 samples)
    trace_id: str | None


class EngineObserver:
    """Metrics, spans and logs of one engine core."""

    def __init__(self, config: FolioConfig, model_name: str, tracing: Tracing | None = None,
                 facts: ModelFacts | None = None):
        obs = config.observability
        lora, spec = config.lora, config.speculative
        self.metrics = EngineMetrics(
            model_name, max_loras=lora.max_loras if lora.enable_lora else None,
            num_spec_positions=spec.num_speculative_tokens if spec.is_enabled else 0,
            prefix=obs.metrics_prefix,
            cache_info=cache_config_info(config, facts) if facts is not None else None
        ) if obs.enable_metrics else None
        self.tracer = (EngineTracer(tracing.tracer, obs.trace_step_detail, spec.is_enabled)
                       if tracing is not None and tracing.enabled else None)
        self._ids: dict[str, _RequestIds] = {}  # sample id → ids for log lines

    def on_add(self, message: AddRequest, sample_ids: list[str]) -> None:
        parsed = parse_traceparent(message.traceparent)
        trace_id = f"{parsed[0]:032x}" if parsed else None
        num_prompt = len(message.prompt_token_ids)
        if self.metrics is not None:
            self.metrics.on_request(len(sample_ids), message.sampling_params.max_tokens)
        for sample_id in sample_ids:
            self._ids[sample_id] = _RequestIds(message.req_id, trace_id)
            if self.metrics is not None:
                self.metrics.on_add(sample_id, message.arrival_time, num_prompt)
            if self.tracer is not None:
                self.tracer.on_add(sample_id, message.traceparent, num_prompt,
                                   message.lora_name)
        log.info("request added", request_id=message.req_id, trace_id=trace_id,
                 num_prompt_tokens=num_prompt, n=len(sample_ids),
                 lora_adapter=message.lora_name)

    def begin_step(self, so: SchedulerOutput) -> tuple[str | None, dict[str, str]]:
        """Before the worker runs ``so``: the traceparents ExecuteStep should carry."""
        for req_id in so.preempted_req_ids:
            ids = self._ids.get(req_id)
            log.info("request preempted", request_id=ids.request_id if ids else req_id,
                     sample_id=req_id, trace_id=ids.trace_id if ids else None,
                     reason="kv_cache_full: no free KV block for this step; its blocks "
                            "are freed and it is recomputed when it is admitted again")
        if self.tracer is None:
            return None, {}
        return self.tracer.begin_step(so)

    def end_step(self, so: SchedulerOutput, outputs: list[EngineCoreOutput],
                 engine: EngineCore, runner_output: ModelRunnerOutput | None = None) -> None:
        if self.tracer is not None:
            self.tracer.end_step(so, outputs, engine.last_draft_outcomes())
        if self.metrics is not None:
            self.metrics.on_step(so, outputs, engine.get_stats())
            if runner_output is not None:
                self.metrics.on_structured_output(runner_output.structured_output)
        for out in outputs:
            if out.finished:
                ids = self._ids.pop(out.req_id, None)
                if ids is not None:
                    log.info("request finished", request_id=ids.request_id,
                             sample_id=out.req_id, trace_id=ids.trace_id,
                             finish_reason=str(out.finish_reason),
                             num_cached_tokens=out.num_cached_tokens)

    def render_metrics(self) -> str:
        return self.metrics.render() if self.metrics is not None else ""
