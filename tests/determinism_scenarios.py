"""The deterministic-mode scenarios (README, "Deterministic mode"): one seeded request
(temperature 0.8, fixed seed, 40 tokens, with logprobs) run alone and four other ways;
its tokens and logprobs are compared with the alone run.

Shared by tests/test_deterministic.py (tiny model) and
tests/test_deterministic_default_model.py (SmolLM2-135M).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine_core.sampling_params import SamplingParams

TARGET = SamplingParams(temperature=0.8, seed=1234, max_tokens=40, ignore_eos=True,
                        logprobs=1)
SCENARIOS = ("batch_of_32", "chunk_16", "chunk_2048", "prefix_cached", "preempted")


@dataclass(frozen=True)
class Outcome:
    """The seeded request's generated token ids and their logprobs."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def first_difference(self, other: "Outcome") -> int | None:
        """Index of the first token whose id or logprob (bitwise) differs; None: none."""
        pairs = zip(zip(self.token_ids, self.logprobs), zip(other.token_ids, other.logprobs))
        for i, (a, b) in enumerate(pairs):
            if a != b:
                return i
        return None if len(self.token_ids) == len(other.token_ids) else len(self.token_ids)


def outcome(output) -> Outcome:
    c = output.outputs[0]
    return Outcome(tuple(c.token_ids), tuple(lp.logprob for lp in c.token_logprobs))


def random_prompts(rng: random.Random, count: int, lo: int, hi: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))]}
            for _ in range(count)]


def run_scenarios(make_llm, prompt_len: int = 100, block_size: int = 16
                  ) -> tuple[Outcome, dict[str, Outcome]]:
    """The alone outcome and one per scenario. ``make_llm(**overrides)`` builds an LLM
    (dtype and deterministic mode already chosen by the caller)."""
    rng = random.Random(0)
    prompt = random_prompts(rng, 1, prompt_len, prompt_len)[0]
    one = lambda llm: outcome(llm.generate(prompt, TARGET, use_tqdm=False)[0])  # noqa: E731
    llm = make_llm(enable_prefix_caching=False)
    alone = one(llm)
    found = {}
    # 31 random others around it (their own temperatures and lengths), one engine step
    others = random_prompts(rng, 31, 2, 150)
    params = [SamplingParams(temperature=0.8, max_tokens=rng.randint(5, 50), ignore_eos=True)
              for _ in others]
    outs = llm.generate(others[:13] + [prompt] + others[13:],
                        params[:13] + [TARGET] + params[13:], use_tqdm=False)
    found["batch_of_32"] = outcome(outs[13])
    for budget in (16, 2048):
        found[f"chunk_{budget}"] = one(make_llm(enable_prefix_caching=False,
                                                max_num_batched_tokens=budget))
    # an earlier request shares all but the prompt's last few tokens
    llm = make_llm(enable_prefix_caching=True)
    llm.generate({"prompt_token_ids": prompt["prompt_token_ids"][:-5] + [7, 8, 9]},
                 TARGET, use_tqdm=False)
    cached = llm.generate(prompt, TARGET, use_tqdm=False)[0]
    assert cached.num_cached_tokens >= block_size, "the prefix cache was not hit"
    found["prefix_cached"] = outcome(cached)
    found["preempted"] = _preempted(make_llm, prompt, rng, block_size)
    return alone, found


def _preempted(make_llm, prompt, rng, block_size) -> Outcome:
    # Short prompts with long outputs are admitted with the seeded request (the newest,
    # so the first victim) and then outgrow the pool. The scheduler's real preempt() is
    # only watched, to be sure it hit the seeded request.
    prompt_blocks = -(-len(prompt["prompt_token_ids"]) // block_size)
    llm = make_llm(enable_prefix_caching=False, num_blocks=prompt_blocks + 20,
                   max_model_len=256)
    preempted = []
    real_preempt = llm.engine.scheduler.preempt

    def watch(victim, plan):
        preempted.append(victim.req_id)
        return real_preempt(victim, plan)
    llm.engine.scheduler.preempt = watch
    others = random_prompts(rng, 5, 10, 30)
    params = [SamplingParams(temperature=0.8, max_tokens=150, ignore_eos=True)] * 5
    outs = llm.generate(others + [prompt], params + [TARGET], use_tqdm=False)
    assert outs[-1].request_id in preempted, "the seeded request was never preempted"
    return outcome(outs[-1])


def differences(alone: Outcome, found: dict[str, Outcome]) -> dict[str, int | None]:
    """Scenario → first differing token (None: bitwise identical)."""
    return {name: alone.first_difference(o) for name, o in found.items()}
