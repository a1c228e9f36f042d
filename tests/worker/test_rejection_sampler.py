"""The rejection sampler: emitted tokens follow the target distribution exactly
(chi-square over 200k draws, drafts close to and far from the target, one-hot and
sampled drafts), greedy verification, and one-hot verification equal to plain
sampling from the same noise."""
import pytest
import torch

from worker.rejection_sampler import rejection_sample
from worker.sampler import TargetDistribution, draw

N = 200_000
P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
CLOSE = 0.8 * P + 0.2 / len(P)
FAR = torch.tensor([0.01, 0.02, 0.02, 0.05, 0.1, 0.8])


def chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = counts.sum() * probs.double()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def verify(q: torch.Tensor | None, k: int, seed: int, one_hot_draft: int | None = None):
    """N requests, each with k drafts (drawn from q, or fixed) over rows of P."""
    gen = torch.Generator().manual_seed(seed)
    rows = N * (k + 1)
    dist = TargetDistribution(greedy=torch.zeros(rows, dtype=torch.int64),
                              probs=P.expand(rows, -1), is_random=torch.ones(rows, dtype=bool))
    noise = torch.empty(rows, len(P)).exponential_(generator=gen)
    if one_hot_draft is not None:
        drafts = torch.full((N, k), one_hot_draft)
    else:
        drafts = torch.multinomial(q, N * k, replacement=True, generator=gen).view(N, k)
    draft_probs = None if q is None else q.expand(rows, -1)
    return rejection_sample(dist, noise, drafts.tolist(), draft_probs), drafts


@pytest.mark.parametrize("q,one_hot", [(CLOSE, None), (FAR, None), (None, 0), (None, 5)],
                         ids=["close", "far", "one-hot-likely", "one-hot-unlikely"])
def test_emitted_tokens_follow_the_target(q, one_hot):
    out, drafts = verify(q, k=2, seed=0, one_hot_draft=one_hot)
    first = torch.tensor([t[0] for t in out])
    assert chi_square_p(first, P) > 0.001
    # The second token, when one is emitted, follows P as well (its draft was judged
    # after the first was accepted).
    second = torch.tensor([t[1] for t in out if len(t) > 1])
    assert len(second) > 2000 and chi_square_p(second, P) > 0.001
    accepted = torch.tensor([len(t) - 1 for t in out], dtype=torch.float64)
    accept_first = (accepted >= 1).double().mean()
    expected = torch.minimum(P, q).sum() if q is not None else P[one_hot]
    assert abs(float(accept_first) - float(expected)) < 0.01
    assert all(t[:len(t) - 1] == d[:len(t) - 1] for t, d in zip(out[:1000], drafts.tolist()))


def test_the_check_catches_a_biased_sampler():
    # Sanity of the statistic: accepting every draft from FAR is far from P.
    _, drafts = verify(FAR, k=1, seed=1)
    assert chi_square_p(drafts[:, 0], P) < 1e-6


def test_greedy_rows_accept_the_argmax_prefix_then_take_it():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3))
    g = logits.argmax(-1).tolist()
    dist = TargetDistribution(logits.argmax(-1), None, torch.zeros(8, dtype=bool))
    # rows 0-3: 3 drafts, the third wrong; rows 4-6: 2 right drafts; row 7: none
    drafts = [[g[0], g[1], (g[2] + 1) % 50], [g[4], g[5]], []]
    assert rejection_sample(dist, None, drafts) == [g[0:3], g[4:7], [g[7]]]


def test_one_hot_verification_emits_what_plain_sampling_draws():
    gen = torch.Generator().manual_seed(5)
    rows = 4000
    probs = torch.rand(rows, 30, generator=gen).softmax(-1)
    dist = TargetDistribution(probs.argmax(-1), probs, torch.ones(rows, dtype=bool))
    noise = torch.empty(rows, 30).exponential_(generator=gen)
    plain = draw(dist, noise).view(-1, 4).tolist()  # 1000 requests, 3 drafts each
    drafts = [[row[0], row[1], (row[2] + 1) % 30] for row in plain]
    out = rejection_sample(dist, noise, drafts)
    assert all(o == p[:3] for o, p in zip(out, plain))
