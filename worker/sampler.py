"""Batched token sampling: penalties, temperature, top-k/top-p/min-p, seeded draws.

Random rows draw with the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)``
i.i.d. picks token t with probability ``probs[t]``. A seeded request draws its noise
row from its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.outputs import TokenLogprobs
from kernels import cpu_extension
from worker.sampling_metadata import SamplingMetadata


def _token_counts(rows: list[list[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """``[len(rows), vocab]`` float32 occurrence counts, built with one scatter on
    ``device`` (counts are small integers: exact in any summation order)."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    lengths = [len(ids) for ids in rows]
    total = sum(lengths)
    if total:
        row_of = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
        flat = torch.from_numpy(row_of * vocab_size + ids).to(device)
        counts.view(-1).index_add_(0, flat, torch.ones(total, device=device))
    return counts


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt + output, presence/frequency over output."""
    if md.output_token_ids is None:
        return logits
    vocab, device = logits.shape[-1], logits.device
    out_counts = _token_counts(md.output_token_ids, vocab, device)
    if md.repetition_penalty is not None:
        seen = (out_counts + _token_counts(md.prompt_token_ids, vocab, device)) > 0
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
        drop |= torch.arange(logits.shape[-1], device=logits.device)[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if md.top_p is not None:
        probs = sorted_logits.softmax(-1)
        # Keep a token while the mass strictly before it is below top_p; the most
        # likely token is always kept.
        mass_before = probs.cumsum(-1) - probs
        drop |= mass_before >= md.top_p[:, None]
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _exponential_noise(shape, md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if len(md.generators) < shape[0]:
        noise.exponential_()
    for row, gen in md.generators.items():
        noise[row].exponential_(generator=gen)
    return noise


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor,
                   num_logprobs: list[int | None]) -> list[TokenLogprobs | None]:
    """Row i's logprob of ``tokens[i]`` under the raw logits, with its rank and its
    ``num_logprobs[i]`` most likely tokens (None: the row asked for none), computed on
    the logits' device and brought to the host in one copy::

        packed[r] = [token id, its logprob, its rank, top ids (max k), top logprobs]

    (ids and ranks are exact in float32: vocabularies stay below 2^24)."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return [None] * len(num_logprobs)
    index = torch.tensor(rows, dtype=torch.int64, device=raw.device)
    logprobs = raw.index_select(0, index).log_softmax(-1)
    chosen = tokens.index_select(0, index)
    sampled = logprobs.gather(-1, chosen[:, None])
    ranks = (logprobs > sampled).sum(-1, keepdim=True) + 1
    parts = [chosen[:, None].float(), sampled, ranks.float()]
    top = max((num_logprobs[i] for i in rows), default=0)
    if top:
        top_vals, top_ids = logprobs.topk(top, dim=-1)
        parts += [top_ids.float(), top_vals]
    packed = torch.cat(parts, dim=1).cpu()
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for r, i in enumerate(rows):
        k, row = num_logprobs[i], packed[r]
        result[i] = TokenLogprobs(
            token_id=int(row[0]), logprob=float(row[1]), rank=int(row[2]),
            top_token_ids=[int(t) for t in row[3:3 + k].tolist()],
            top_logprobs=row[3 + top:3 + top + k].tolist())
    return result


@dataclass(slots=True)
class TargetDistribution:
    """What each row samples from: ``greedy`` (the argmax after min_tokens bans and
    penalties) and, unless every row is greedy, ``probs`` after temperature and
    top-k/top-p/min-p; rows with temperature 0 (``is_random`` False) take ``greedy``."""

    greedy: torch.Tensor  # [B] int64
    probs: torch.Tensor | None  # [B, vocab] float32
    is_random: torch.Tensor  # [B] bool


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the first index of each row's maximum (as ``argmax``, ties to
    the lowest index; a NaN counts as the largest). On a CPU the native kernel
    (``kernels/csrc/row_argmax.cpp``) splits the rows over the threads: torch's
    ``max(-1)`` ran them on one (0.95 of a 1.4 ms sampling step for 32 rows of a
    49152-token vocabulary), and ``argmax`` is 2.5-3x slower still. One row runs on one
    thread either way: the kernel still reads a 16-bit row in under half torch's time
    (17 vs 36 us for 49152 bf16 logits), but a float32 row slower (31 vs 23 us)."""
    if (x.device.type == "cpu" and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (x.shape[0] > 1 or x.dtype != torch.float32) and x.shape[1] > 0
            and cpu_extension.is_available()):
        return cpu_extension.require().row_argmax(x)
    return x.max(-1).indices


def target_distribution(logits: torch.Tensor, md: SamplingMetadata) -> TargetDistribution:
    """Every row's processed distribution (the sampler's, and the rejection sampler's
    target p), on the logits' device."""
    if md.logit_bias is not None:  # OpenAI's logit_bias: added before anything else
        logits = logits.index_put(md.logit_bias[:2], md.logit_bias[2], accumulate=True)
    raw = logits
    for row, banned in md.min_tokens_stop_ids.items():
        logits = logits.clone() if logits is raw else logits
        logits[row, banned] = float("-inf")
    logits = apply_penalties(logits, md)
    greedy = row_argmax(logits)
    if md.all_greedy:
        return TargetDistribution(greedy, None, md.temperature > 0)
    temp = torch.where(md.temperature > 0, md.temperature, 1.0)
    scaled = apply_top_k_top_p_min_p(logits / temp[:, None], md)
    return TargetDistribution(greedy, scaled.softmax(-1), md.temperature > 0)


def draw(dist: TargetDistribution, noise: torch.Tensor | None) -> torch.Tensor:
    """One token per row: ``argmax(probs / noise)`` (``noise`` i.i.d. Exp(1)) for random
    rows, the argmax for greedy ones."""
    if dist.probs is None:
        return dist.greedy
    return torch.where(dist.is_random, row_argmax(dist.probs / noise), dist.greedy)


class Sampler:
    """Turns a step's float32 logits ``[B, vocab]`` into one token per row, on the
    logits' device (the metadata's tensors and generators must live there too)."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        dist = target_distribution(logits, md)
        noise = None if dist.probs is None else _exponential_noise(
            dist.probs.shape, md, dist.probs.device)
        tokens = draw(dist, noise)
        return tokens, token_logprobs(logits, tokens, md.num_logprobs)
