"""The engine core's spans.

    chat <model>                        (API)     the request's root span
    └─ engine.request                   (engine)  add → finish; events: preempted, resumed,
       │                                          first_token; attributes: finish reason,
       │                                          token counts
       ├─ engine.queue                  (engine)  waiting for a slot (again after preemption)
       ├─ engine.prefill / engine.decode (engine) per step (trace_step_detail: step) or per
       │                                          phase (phase); tokens, new blocks, prefix
       │                                          hits, draft tokens proposed and accepted
       │                                          (speculative decoding); linked to the
       │                                          engine.step span
       └─ worker.add_request            (worker)  the worker building the request's state

    engine.step                         (engine)  one traced step, its own trace, linked
    └─ worker.execute                   (worker)  to every traced request it served;
                                                  forward / sampling time; one per
                                                  tensor-parallel rank (folio.rank);
                                                  folio.num_decode_steps > 1: a run of
                                                  decode steps (a decode span's tokens)

A request is traced when the API sampled it (the traceparent it sends says so); a step
is traced when it serves at least one traced request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine_core.outputs import EngineCoreOutput
from engine_core.scheduler_output import SchedulerOutput
from engine_core.spec.speculator import DraftOutcome
from observability.tracing import context_from_traceparent, is_sampled, traceparent_of


@dataclass(slots=True)
class _RequestTrace:
    span: Any
    traceparent: str
    num_prompt_tokens: int
    queue_span: Any | None = None
    phase: str | None = None  # "prefill" or "decode" of the open phase span
    phase_span: Any | None = None
    num_phase_steps: int = 0
    num_phase_tokens: int = 0
    num_phase_blocks: int = 0
    num_phase_draft_tokens: int = 0
    num_phase_accepted_tokens: int = 0
    last_end_ns: int | None = None
    is_requeued: bool = False  # queued again after a preemption
    num_output_tokens: int = 0
    links: list = field(default_factory=list)


class EngineTracer:
    """Creates and ends the engine core's spans as requests and steps go by."""

    def __init__(self, tracer, step_detail: str = "step", record_drafts: bool = False):
        """``record_drafts``: speculative decoding is on, so every engine.decode span
        carries its request's draft tokens proposed and accepted (0 when none)."""
        from opentelemetry import trace
        self._trace = trace
        self.tracer = tracer
        self.per_step = step_detail == "step"
        self.record_drafts = record_drafts
        self.requests: dict[str, _RequestTrace] = {}
        self._step_span = None
        self._step_start_ns = 0

    def _child_context(self, span):
        return self._trace.set_span_in_context(span)

    def on_add(self, req_id: str, traceparent: str | None, num_prompt_tokens: int,
               lora_name: str | None = None) -> None:
        if not is_sampled(traceparent):
            return
        attributes = {"folio.request_id": req_id, "gen_ai.usage.input_tokens": num_prompt_tokens}
        if lora_name is not None:
            attributes["folio.lora_adapter"] = lora_name
        span = self.tracer.start_span(
            "engine.request", context=context_from_traceparent(traceparent),
            attributes=attributes)
        rt = _RequestTrace(span, traceparent_of(span), num_prompt_tokens)
        rt.queue_span = self.tracer.start_span("engine.queue",
                                               context=self._child_context(span))
        self.requests[req_id] = rt

    def begin_step(self, so: SchedulerOutput) -> tuple[str | None, dict[str, str]]:
        """Open the step span; (its traceparent, traceparents of traced new requests)."""
        for req_id in so.preempted_req_ids:
            rt = self.requests.get(req_id)
            if rt is not None:
                rt.span.add_event("preempted", {"folio.reason": "kv_cache_full"})
                self._end_phase(rt)
                rt.queue_span = self.tracer.start_span(
                    "engine.queue", context=self._child_context(rt.span),
                    attributes={"folio.after_preemption": True})
                rt.is_requeued = True
        traced = [r for r in so.num_scheduled_tokens if r in self.requests]
        if not traced:
            self._step_span = None
            return None, {}
        self._step_start_ns = time.time_ns()
        self._step_span = self.tracer.start_span(
            "engine.step", start_time=self._step_start_ns,
            links=[self._trace.Link(self.requests[r].span.get_span_context()) for r in traced],
            attributes={"folio.batch_size": len(so.num_scheduled_tokens),
                        "folio.num_tokens": so.total_num_scheduled_tokens,
                        "folio.num_new_requests": len(so.scheduled_new_reqs),
                        "folio.num_preempted": len(so.preempted_req_ids),
                        "folio.num_decode_steps": so.num_decode_steps})
        new_ids = {n.req_id for n in so.scheduled_new_reqs}
        request_traceparents = {}
        for req_id in traced:
            rt = self.requests[req_id]
            if req_id in new_ids:
                request_traceparents[req_id] = rt.traceparent
                if rt.queue_span is not None:
                    rt.queue_span.end(end_time=self._step_start_ns)
                    rt.queue_span = None
                if rt.is_requeued:
                    rt.span.add_event("resumed", timestamp=self._step_start_ns)
                    rt.is_requeued = False
        return traceparent_of(self._step_span), request_traceparents

    def end_step(self, so: SchedulerOutput, outputs: list[EngineCoreOutput],
                 draft_outcomes: dict[str, DraftOutcome] | None = None) -> None:
        """Close the step: per-request phase spans (``draft_outcomes``: the drafts each
        request verified in it), first-token events, finished requests."""
        end_ns = time.time_ns()
        draft_outcomes = draft_outcomes or {}
        if self._step_span is not None:
            step_link = self._trace.Link(self._step_span.get_span_context())
            computed = {n.req_id: (n.num_computed_tokens, len(n.block_ids))
                        for n in so.scheduled_new_reqs}
            computed.update({c.req_id: (c.num_computed_tokens, len(c.new_block_ids))
                             for c in so.scheduled_cached_reqs})
            for req_id, num_tokens in so.num_scheduled_tokens.items():
                rt = self.requests.get(req_id)
                if rt is not None:
                    num_computed, num_new_blocks = computed.get(req_id, (0, 0))
                    self._record_step(rt, num_tokens, num_computed, num_new_blocks,
                                      so.num_cached_tokens.get(req_id), step_link, end_ns,
                                      draft_outcomes.get(req_id))
            self._step_span.end(end_time=end_ns)
            self._step_span = None
        for out in outputs:
            rt = self.requests.get(out.req_id)
            if rt is None:
                continue
            if out.new_token_ids and rt.num_output_tokens == 0:
                rt.span.add_event("first_token", timestamp=end_ns)
            rt.num_output_tokens += len(out.new_token_ids)
            if out.finished:
                self._finish(out, rt, end_ns)

    def _record_step(self, rt: _RequestTrace, num_tokens: int, num_computed: int,
                     num_new_blocks: int, num_cached: int | None, step_link, end_ns: int,
                     drafts: DraftOutcome | None = None):
        phase = "prefill" if num_computed < rt.num_prompt_tokens else "decode"
        # phase_span None: per_step was on for the last step (a live retune may flip it)
        if self.per_step or rt.phase != phase or rt.phase_span is None:
            self._end_phase(rt)
            rt.phase = phase
            rt.phase_span = self.tracer.start_span(
                f"engine.{phase}", context=self._child_context(rt.span),
                start_time=self._step_start_ns, links=[step_link])
            rt.num_phase_steps = rt.num_phase_tokens = rt.num_phase_blocks = 0
            rt.num_phase_draft_tokens = rt.num_phase_accepted_tokens = 0
            rt.links = []
        elif len(rt.links) < 32:  # a phase span links its first 32 steps
            rt.links.append(step_link)
        rt.num_phase_steps += 1
        rt.num_phase_tokens += num_tokens
        rt.num_phase_blocks += num_new_blocks
        span = rt.phase_span
        span.set_attributes({"folio.num_steps": rt.num_phase_steps,
                             "folio.num_tokens": rt.num_phase_tokens,
                             "folio.num_new_blocks": rt.num_phase_blocks})
        if num_cached is not None:
            span.set_attribute("folio.num_cached_tokens", num_cached)
        if self.record_drafts and phase == "decode":
            drafts = drafts or DraftOutcome(0, 0)
            rt.num_phase_draft_tokens += drafts.num_draft_tokens
            rt.num_phase_accepted_tokens += drafts.num_accepted_tokens
            span.set_attributes({"folio.spec.num_draft_tokens": rt.num_phase_draft_tokens,
                                 "folio.spec.num_accepted_tokens":
                                     rt.num_phase_accepted_tokens})
        rt.last_end_ns = end_ns
        if self.per_step:
            self._end_phase(rt)

    def _end_phase(self, rt: _RequestTrace) -> None:
        if rt.phase_span is not None:
            for link in rt.links:
                rt.phase_span.add_link(link.context)
            rt.phase_span.end(end_time=rt.last_end_ns)
            rt.phase_span = None
            rt.phase = None

    def _finish(self, out: EngineCoreOutput, rt: _RequestTrace, end_ns: int) -> None:
        self._end_phase(rt)
        if rt.queue_span is not None:  # aborted while queued
            rt.queue_span.end(end_time=end_ns)
        rt.span.set_attributes({"gen_ai.usage.output_tokens": rt.num_output_tokens,
                                "gen_ai.response.finish_reasons": [str(out.finish_reason)],
                                "folio.num_cached_tokens": out.num_cached_tokens})
        rt.span.end(end_time=end_ns)
        del self.requests[out.req_id]
