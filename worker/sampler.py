"""Batched token sampling: penalties, temperature, top-k/top-p/min-p, seeded draws.

Random rows draw with the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)``
i.i.d. picks token t with probability ``probs[t]``. A seeded request draws its noise
row from its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from engine_core.outputs import TokenLogprobs
from worker.sampling_metadata import SamplingMetadata


def _token_counts(rows: list[list[int]], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    for i, ids in enumerate(rows):
        if ids:
            counts[i].index_add_(0, torch.tensor(ids), torch.ones(len(ids)))
    return counts


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt + output, presence/frequency over output."""
    if md.output_token_ids is None:
        return logits
    vocab = logits.shape[-1]
    out_counts = _token_counts(md.output_token_ids, vocab)
    if md.repetition_penalty is not None:
        seen = (out_counts + _token_counts(md.prompt_token_ids, vocab)) > 0
        rep = md.repetition_penalty[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty[:, None] * out_counts
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty[:, None] * (out_counts > 0)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus and min-p sets."""
    if md.min_p is not None:
        probs = logits.softmax(-1)
        floor = md.min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if md.top_k is None and md.top_p is None:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if md.top_k is not None:
        k = torch.where(md.top_k > 0, md.top_k, logits.shape[-1])
        drop |= torch.arange(logits.shape[-1])[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if md.top_p is not None:
        probs = sorted_logits.softmax(-1)
        # Keep a token while the mass strictly before it is below top_p; the most
        # likely token is always kept.
        mass_before = probs.cumsum(-1) - probs
        drop |= mass_before >= md.top_p[:, None]
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _exponential_noise(shape, md: SamplingMetadata) -> torch.Tensor:
    noise = torch.empty(shape, dtype=torch.float32)
    if len(md.generators) < shape[0]:
        noise.exponential_()
    for row, gen in md.generators.items():
        noise[row].exponential_(generator=gen)
    return noise


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, md: SamplingMetadata):
    logprobs = raw.log_softmax(-1)
    top_vals, top_ids = logprobs.topk(md.max_num_logprobs, dim=-1) if md.max_num_logprobs \
        else (None, None)
    sampled = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    ranks = (logprobs > sampled[:, None]).sum(-1) + 1
    result: list[TokenLogprobs | None] = []
    for i, k in enumerate(md.num_logprobs):
        if k is None:
            result.append(None)
            continue
        result.append(TokenLogprobs(
            token_id=int(tokens[i]), logprob=float(sampled[i]), rank=int(ranks[i]),
            top_token_ids=top_ids[i, :k].tolist() if k else [],
            top_logprobs=top_vals[i, :k].tolist() if k else []))
    return result


class Sampler:
    """Turns a step's float32 logits ``[B, vocab]`` into one token per row."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        raw = logits
        for row, banned in md.min_tokens_stop_ids.items():
            logits = logits.clone() if logits is raw else logits
            logits[row, banned] = float("-inf")
        logits = apply_penalties(logits, md)
        greedy = logits.argmax(-1)
        if md.all_greedy:
            tokens = greedy
        else:
            temp = torch.where(md.temperature > 0, md.temperature, 1.0)
            scaled = apply_top_k_top_p_min_p(logits / temp[:, None], md)
            probs = scaled.softmax(-1)
            drawn = (probs / _exponential_noise(probs.shape, md)).argmax(-1)
            tokens = torch.where(md.temperature > 0, drawn, greedy)
        logprobs = _logprobs(raw, tokens, md) if md.max_num_logprobs is not None or any(
            k is not None for k in md.num_logprobs) else [None] * len(md.num_logprobs)
        return tokens, logprobs
