"""Runs of decode steps through the real model runner (engine_core/decode_steps.py):
the offline API gives the same tokens, logprobs and ends with runs as without."""
from __future__ import annotations

import pytest

from engine_core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llms(tiny_llama_dir, default_model_path):
    from folio import LLM
    kw = dict(model=str(tiny_llama_dir), tokenizer=str(default_model_path), dtype="float32",
              max_model_len=256, num_blocks=128, block_size=16,
              **{"observability.log_level": "warning"})
    # max_run_ms null: the runs are held to num_scheduler_steps only, not to the learned
    # step cost, so how many steps a run gets does not depend on how loaded the machine is
    return (LLM(**kw, **{"scheduler.num_scheduler_steps": 1}),
            LLM(**kw, **{"scheduler.num_scheduler_steps": 5, "scheduler.max_run_ms": None}))


def summary(outputs):
    return [[(c.token_ids, c.finish_reason, c.text,
              [round(lp.logprob, 4) for lp in c.token_logprobs or []]) for c in o.outputs]
            for o in outputs]


def run_lengths(llm, monkeypatch) -> list[int]:
    """Records the num_decode_steps of every step the runner executes."""
    seen = []
    execute = llm.runner.execute_model

    def recording(so, *args, **kwargs):
        seen.append(so.num_decode_steps)
        return execute(so, *args, **kwargs)
    monkeypatch.setattr(llm.runner, "execute_model", recording)
    return seen


def test_runs_match_single_steps(llms, monkeypatch):
    single, runs = llms
    seen = run_lengths(runs, monkeypatch)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,", "Hello"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=17, ignore_eos=True,
                       repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, n=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, min_tokens=9),
    ]
    want = single.generate(prompts, params, use_tqdm=False)
    got = runs.generate(prompts, params, use_tqdm=False)
    assert summary(got) == summary(want)
    assert [len(c.token_ids) for c in got[0].outputs] == [23]
    assert max(seen) == 5 and len(seen) < 25


def test_a_stop_string_inside_a_run_cuts_there(llms):
    single, runs = llms
    free = single.generate("Once upon a time", SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    want = single.generate("Once upon a time", params, use_tqdm=False)
    got = runs.generate("Once upon a time", params, use_tqdm=False)
    assert summary(got) == summary(want)
    assert got[0].outputs[0].finish_reason == "stop"
    assert len(got[0].outputs[0].token_ids) < 30
