"""Multi-step decoding: one plan, several decode steps run back to back by the worker.

A plain decode has computed all its known tokens but the last (c = N - 1). Granted k
steps, the worker computes t[c] and samples x1, computes x1 and samples x2, and so on;
the k sampled tokens come back together::

    position   c      c+1   ...  c+k-1
    input      t[c]   x1    ...  x(k-1)      num_computed_tokens += k (at schedule)
    output     x1     x2    ...  xk

Once they are appended, c = N + k - 1 again. A stop rule that fires at x_j drops the
tokens after it and finishes the request (their K/V slots go with its blocks). A run
never reaches past ``max_tokens`` or ``max_model_len``.

The engine core and the API then handle a request's tokens once per run instead of
once per token, which is most of a served token's CPU outside the forward pass on a
small machine. The price is that a request arriving meanwhile waits for the run in
flight, so runs are granted only when nobody waits: every running request is a plain
decode of this plan, no request is queued or parked, and none follows a grammar (the
worker's grammar state advances per planned step). Speculative decoding grants drafts
instead, never runs. A run is held to the steps the learned step cost predicts to fit
within ``scheduler.max_run_ms`` (and ``max_step_ms``, when set: the smaller), so
the wait it adds is bounded in time, not in steps: at batch 1 on a fast step the full
``num_scheduler_steps``, at a large batch whose steps are slow, one
(engine_core/step_cost.py).
"""
from __future__ import annotations

from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request
from engine_core.step_cost import StepCost, StepShape
from engine_core.step_plan import StepPlan


def steps_within(num_steps: int, max_run_ms: float | None, step_cost: StepCost,
                 decodes: list[Request]) -> int:
    """``num_steps``, or with ``max_run_ms`` the steps of these decodes predicted to
    fit within it (1 until the cost of such a step is known)."""
    if max_run_ms is None or num_steps <= 1:
        return num_steps
    step_ms = step_cost.predict_ms(StepShape(0, len(decodes),
                                             sum(r.num_computed_tokens for r in decodes)))
    if step_ms is None or step_ms <= 0:
        return 1
    return max(1, min(num_steps, int(max_run_ms / step_ms)))


def is_plain_run(plan: StepPlan, running: list[Request]) -> bool:
    """Whether every running request is a plain one-token decode of ``plan`` past its
    first output token (the prompt's last token takes an ordinary step: its prompt
    logprobs are computed there) and the plan holds nothing else (no newcomer, no
    preemption)."""
    if plan.new_reqs or plan.has_preemption or len(plan.num_scheduled_tokens) != len(running):
        return False
    return all(plan.num_scheduled_tokens.get(r.req_id) == 1 and r.req_id in plan.cached_reqs
               and r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens > 0
               and r.sampling_params.structured_outputs is None for r in running)


def grant_decode_steps(plan: StepPlan, running: list[Request], num_steps: int,
                       kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
    """Extend each running decode of ``plan`` to up to ``num_steps`` steps, within the
    budget the plan left and the free KV blocks (a request that gets no room keeps its
    one step; nobody is preempted for a run). The caller checked ``is_plain_run``."""
    for request in running:
        # k tokens come back: never past max_tokens or max_model_len
        room = min(request.max_tokens - request.num_output_tokens,
                   max_model_len - request.num_tokens + 1)
        extra = min(num_steps, room) - 1
        extra = min(extra, plan.token_budget)
        if extra <= 0:
            continue
        new_blocks = kv_cache_manager.allocate_slots(request, 1 + extra)
        if new_blocks is None:
            continue
        plan.add_decode_steps(request, extra, new_blocks.get_block_ids())
