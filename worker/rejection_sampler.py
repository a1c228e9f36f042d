"""Exact verification of draft tokens: the rejection sampler of speculative decoding.

A request verifying k drafts d_1..d_k owns k+1 consecutive target rows. Row i holds
p_i, the model's distribution of the token after input i (input 0 is the request's
last known token, input i >= 1 is d_i), so d_{i+1} is judged by p_i and the row after
the last accepted draft yields one token of the model's own::

    rows      p_0   p_1   ...   p_{k-1}   p_k
    judges    d_1   d_2   ...   d_k       (bonus: all k accepted)

Standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept d
with probability min(1, p(d) / q(d)), where q is the distribution d was drawn from; at
the first rejection emit a token from the residual max(0, p - q), normalised, and
stop; after k acceptances emit the bonus token from p_k. Each emitted token is then
distributed exactly as the model alone would sample it.

Every row uses one row E of i.i.d. Exp(1) noise (the sampler's exponential race:
argmax(w / E) picks t with probability w[t] / sum(w)):

* q one-hot (n-gram drafts; ``draft_probs`` None): draw the target's own sample
  x = argmax(p / E) and accept iff d == x. P(accept) = p(d) = min(1, p(d) / 1), and a
  rejected row emits x, distributed as p without d, renormalised: the residual of a
  one-hot q. The emitted tokens are exactly those sampling without drafts draws from
  the same noise, so a seeded request gives the same tokens with n-gram on or off.
* q a distribution (a draft model that sampled): u = exp(-E[d]) is uniform and
  independent of E's other entries. Accept iff u * q(d) <= p(d); a rejected row emits
  argmax(max(0, p - q) / E). That race never reads E[d] (the residual is 0 at a
  rejected d, since rejection needs p(d) < q(d)), so it is independent of u.
* greedy rows (temperature 0): p is a point mass on the argmax: accept iff d equals
  it, and emit it.
"""
from __future__ import annotations

from itertools import chain

import torch

from worker.sampler import TargetDistribution, draw


def rejection_sample(dist: TargetDistribution, noise: torch.Tensor | None,
                     draft_token_ids: list[list[int]],
                     draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """The tokens each request emits: its accepted drafts, then one of the model's.

    Request r owns ``len(draft_token_ids[r]) + 1`` consecutive rows of ``dist`` and
    ``noise`` (``[rows, vocab]``, i.i.d. Exp(1); None when every row is greedy).
    ``draft_probs[row]`` is the q that drew the draft judged by ``row`` (``[rows,
    vocab]``; None: every draft is one-hot). A request without drafts samples one
    token, as the plain sampler would.
    """
    ks = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64)
    num_reqs, max_k = len(ks), int(ks.max()) if len(ks) else 0
    starts = torch.cumsum(ks + 1, 0) - (ks + 1)
    samples = draw(dist, noise)  # the model's own token at every row
    if max_k == 0:
        return [[t] for t in samples.tolist()]
    is_draft = torch.arange(max_k)[None, :] < ks[:, None]
    drafts = torch.full((num_reqs, max_k), -1, dtype=torch.int64)
    drafts[is_draft] = torch.tensor(list(chain.from_iterable(draft_token_ids)),
                                    dtype=torch.int64)  # row-major, as is_draft
    rows = torch.where(is_draft, starts[:, None] + torch.arange(max_k)[None, :], 0)
    safe = drafts.clamp(min=0)
    accept = samples[rows] == drafts
    use_q = draft_probs is not None and dist.probs is not None
    if use_q:
        u = torch.exp(-noise[rows, safe])
        by_ratio = u * draft_probs[rows, safe] <= dist.probs[rows, safe]
        accept = torch.where(dist.is_random[rows], by_ratio, accept)
    accept &= is_draft
    num_accepted = accept.long().cumprod(1).sum(1)
    last_rows = starts + num_accepted
    final = samples[last_rows]
    if use_q:
        rejected = (num_accepted < ks) & dist.is_random[last_rows]
        if bool(rejected.any()):
            at = last_rows[rejected]
            residual = (dist.probs[at] - draft_probs[at]).clamp(min=0)
            final[rejected] = (residual / noise[at]).argmax(-1)
    return [row[:a] + [t] for row, a, t in zip(drafts.tolist(), num_accepted.tolist(),
                                               final.tolist())]
