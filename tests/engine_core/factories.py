"""Factories for engine-core tests: requests, schedulers, engines, step loops."""
from __future__ import annotations

import itertools

from config.schema import CacheConfig, SchedulerConfig
from engine_core.engine import EngineCore
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import Scheduler
from tests.engine_core.fake_executor import FakeExecutor, default_token_fn

_arrivals = itertools.count()


def make_request(req_id: str, prompt: list[int] | int, max_tokens: int = 4,
                 arrival_time: float | None = None, **kw) -> Request:
    """A Request; an int prompt means that many distinct tokens (0, 1, 2, ...)."""
    tokens = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
    req_kw = {k: kw.pop(k) for k in ("eos_token_ids", "cache_salt", "lora_id",
                                      "parent_req_id", "index", "tenant",
                                      "tenant_weight") if k in kw}
    params = SamplingParams(max_tokens=max_tokens, **kw)
    arrival = float(next(_arrivals)) if arrival_time is None else arrival_time
    return Request(req_id=req_id, prompt_token_ids=tokens, sampling_params=params,
                   arrival_time=arrival, **req_kw)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
                   max_num_batched_tokens: int = 16, max_num_seqs: int = 8,
                   enable_chunked_prefill: bool = True, policy: str = "fcfs",
                   enable_prefix_caching: bool = True,
                   hash_algorithm: str = "sha256",
                   max_step_ms: float | None = None,
                   num_scheduler_steps: int = 1,
                   max_run_ms: float | None = None,
                   fair_step_factor: float = 0.0) -> Scheduler:
    """A Scheduler; the fair step bound is off unless asked for (it reads step times,
    which a test must drive on a clock of its own)."""
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        enable_chunked_prefill=enable_chunked_prefill, policy=policy,
                        max_step_ms=max_step_ms, num_scheduler_steps=num_scheduler_steps,
                        max_run_ms=max_run_ms, fair_step_factor=fair_step_factor),
        CacheConfig(enable_prefix_caching=enable_prefix_caching, hash_algorithm=hash_algorithm),
        num_blocks, block_size, max_model_len)


def make_engine(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
                max_num_batched_tokens: int = 16, max_num_seqs: int = 8,
                enable_chunked_prefill: bool = True, policy: str = "fcfs",
                enable_prefix_caching: bool = True, eos_token_ids=(), vocab_size=None,
                token_fn=default_token_fn, speculative_config=None,
                draft_fn=None, num_scheduler_steps: int = 1,
                max_run_ms: float | None = None,
                fair_step_factor: float = 0.0) -> EngineCore:
    """An EngineCore on the fake executor (the fair step bound off unless asked for)."""
    executor = FakeExecutor(block_size, token_fn, draft_fn)
    return EngineCore(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        enable_chunked_prefill=enable_chunked_prefill, policy=policy,
                        num_scheduler_steps=num_scheduler_steps, max_run_ms=max_run_ms,
                        fair_step_factor=fair_step_factor),
        CacheConfig(enable_prefix_caching=enable_prefix_caching),
        num_blocks, block_size, max_model_len, executor, eos_token_ids, vocab_size,
        speculative_config=speculative_config)


def run_step(scheduler: Scheduler, executor: FakeExecutor):
    """One schedule -> execute -> update round; returns (scheduler_output, outputs)."""
    so = scheduler.schedule()
    mro = executor.execute_model(so)
    return so, scheduler.update_from_output(so, mro)


def run_to_completion(engine: EngineCore, max_steps: int = 1000) -> dict[str, list]:
    """Step until idle; returns each request's outputs in order."""
    by_req: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return by_req
        for out in engine.step():
            by_req.setdefault(out.req_id, []).append(out)
    raise AssertionError(f"engine did not finish within {max_steps} steps")
