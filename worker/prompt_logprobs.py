"""Logprobs of prompt tokens (``prompt_logprobs``, and ``echo`` with ``logprobs``).

A prefill chunk computes positions ``[start, start + n)`` of a request; the hidden
state at position p gives the distribution of token p + 1, so the chunk scores prompt
tokens ``start + 1 .. min(start + n, P - 1)`` (P prompt tokens)::

    prompt      t0   t1   t2   t3   t4        P = 5
    position     0    1    2    3    4
    scores      t1   t2   t3   t4   (first output token: the sampler's job)

Logits are computed ``max_rows`` positions at a time, so a long chunk never holds a
``[chunk, vocab]`` float32 block at once. Values are the model's raw distribution, as
for sampled tokens (before temperature, penalties and logit_bias).
"""
from __future__ import annotations

import torch

from engine_core.outputs import PromptLogprobs, TokenLogprobs
from worker.input_batch import InputBatch

MAX_ROWS = 256


def _score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(-1, targets[:, None])
    ranks = (logprobs > chosen).sum(-1)
    chosen, ranks = chosen[:, 0].tolist(), (ranks + 1).tolist()
    if k:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    else:
        top_vals = top_ids = [[] for _ in chosen]
    return [TokenLogprobs(t, lp, r, ids, vals) for t, lp, r, ids, vals
            in zip(targets.tolist(), chosen, ranks, top_ids, top_vals)]


def compute_prompt_logprobs(model, hidden: torch.Tensor, batch: InputBatch,
                            max_rows: int = MAX_ROWS) -> dict[str, PromptLogprobs]:
    """The prompt tokens each request with ``prompt_logprobs`` scored in this step.

    Reads each state's ``num_computed_tokens`` as it was before the step ran."""
    result: dict[str, PromptLogprobs] = {}
    qsl = batch.request_start_loc
    for i, state in enumerate(batch.scheduled_states):
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = state.num_computed_tokens
        end = min(start + qsl[i + 1] - qsl[i], state.num_prompt_tokens - 1)
        if end <= start:
            continue
        targets = torch.tensor(state.token_ids[start + 1:end + 1], dtype=torch.int64,
                               device=hidden.device)
        scored: list[TokenLogprobs] = []
        for a in range(0, end - start, max_rows):
            rows = hidden[qsl[i] + a:qsl[i] + min(a + max_rows, end - start)]
            scored += _score(model.compute_logits(rows), targets[a:a + max_rows], k)
        result[state.req_id] = PromptLogprobs(start + 1, scored)
    return result
