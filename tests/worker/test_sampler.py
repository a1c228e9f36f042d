"""The batched sampler: distributions, seeds, penalties, min_tokens, logprobs.

Every test runs on the CPU and, where there is one, on a CUDA device: the sampler works
on the logits' device, with per-request generators there.
"""
import math

import pytest
import torch

from engine_core.worker_sampling import WorkerSamplingParams
from worker.request_state import make_generator
from worker.sampler import Sampler
from worker.sampling_metadata import SamplingMetadata

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
NO_CUDA = "needs a CUDA device (the GPU check runs these there)"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_CUDA))])
def device(request) -> torch.device:
    return torch.device(request.param)


def sample(logits, params, generators=None, prompts=None, outputs=None, eos=(5,)):
    """Sample on ``logits``' device; the tokens come back on the host for comparison."""
    b = logits.shape[0]
    md = SamplingMetadata.build(params, generators or [None] * b, prompts or [[]] * b,
                                outputs or [[]] * b, eos, logits.device)
    tokens, logprobs = Sampler()(logits, md)
    assert tokens.device == logits.device
    return tokens.cpu(), logprobs


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    probs = (LOGITS / temperature).softmax(-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = probs.argsort(descending=True)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        before = 0.0
        for t in order.tolist():
            if before >= top_p:
                keep[t] = False
            before += probs[t].item()
    if min_p:
        keep &= probs >= min_p * probs.max()
    p = torch.where(keep, probs, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=2.0),
    dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.7, top_k=4, top_p=0.9), dict(temperature=1.0, min_p=0.2),
])
def test_draws_follow_the_processed_distribution(kw, device):
    torch.manual_seed(1)
    n = 40_000
    params = [WorkerSamplingParams(**kw)] * n
    tokens, _ = sample(LOGITS.expand(n, -1).to(device), params)
    freq = torch.bincount(tokens, minlength=len(LOGITS)).double() / n
    want = expected(**kw).double()
    # 5 standard errors of a binomial proportion, per token
    tol = 5 * torch.sqrt(want * (1 - want) / n) + 1e-9
    assert torch.all((freq - want).abs() <= tol), (freq, want)
    assert torch.all(freq[want == 0] == 0)


def test_greedy_takes_argmax_and_ignores_noise(device):
    logits = torch.randn(8, 100, device=device)
    tokens, _ = sample(logits, [WorkerSamplingParams(temperature=0.0)] * 8)
    assert torch.equal(tokens, logits.argmax(-1).cpu())


def test_seeded_rows_do_not_depend_on_the_batch(device):
    torch.manual_seed(0)
    row = torch.randn(1, 1000, device=device)
    gen = make_generator(7, 0, 1000, device)
    alone = [sample(row, [WorkerSamplingParams(seed=7)], [gen])[0].item() for _ in range(5)]
    gen = make_generator(7, 0, 1000, device)
    mixed = []
    for step in range(5):
        others = torch.randn(3 + step, 1000, device=device)
        batch = torch.cat([others[:2], row, others[2:]])
        params = [WorkerSamplingParams()] * 2 + [WorkerSamplingParams(seed=7)] + \
            [WorkerSamplingParams(seed=step)] * (batch.shape[0] - 3)
        gens = [None, None, gen] + [make_generator(step, 0, 1000, device)] * (batch.shape[0] - 3)
        mixed.append(sample(batch, params, gens)[0][2].item())
    assert mixed == alone


def test_generator_fast_forward_resumes_the_stream(device):
    row = torch.randn(1, 500, device=device)
    gen = make_generator(3, 0, 500, device)
    stream = [sample(row, [WorkerSamplingParams(seed=3)], [gen])[0].item() for _ in range(6)]
    resumed = make_generator(3, 4, 500, device)
    assert [sample(row, [WorkerSamplingParams(seed=3)], [resumed])[0].item()
            for _ in range(2)] == stream[4:]


def test_penalties(device):
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]] * 3, device=device)
    params = [WorkerSamplingParams(temperature=0, repetition_penalty=2.0),
              WorkerSamplingParams(temperature=0, frequency_penalty=1.0),
              WorkerSamplingParams(temperature=0, presence_penalty=1.5)]
    md = SamplingMetadata.build(params, [None] * 3, [[0], [], []], [[3], [0, 0], [0, 0]], (),
                                device)
    from worker.sampler import apply_penalties
    out = apply_penalties(logits, md)
    assert out[0].tolist() == [1.5, 2.0, 1.0, -2.0]  # prompt token 0 and output token 3
    assert out[1].tolist() == [1.0, 2.0, 1.0, -1.0]  # 3 - 2 * 1.0
    assert out[2].tolist() == [1.5, 2.0, 1.0, -1.0]  # 3 - 1.5 once
    tokens, _ = sample(logits, params, prompts=[[0], [], []], outputs=[[3], [0, 0], [0, 0]])
    assert tokens.tolist() == [1, 1, 1]


def test_min_tokens_bans_eos_and_stop_ids(device):
    logits = torch.tensor([[0.0, 5.0, 9.0, 1.0]] * 2, device=device)
    params = [WorkerSamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,)),
              WorkerSamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,))]
    tokens, _ = sample(logits, params, outputs=[[0], [0, 0]], eos=(2,))
    assert tokens.tolist() == [3, 2]  # row 0 still under min_tokens: 2 and 1 banned


def test_logprobs_are_raw_and_ranked(device):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], device=device)
    tokens, lps = sample(logits, [WorkerSamplingParams(temperature=0, logprobs=2)])
    lp = lps[0]
    ref = logits.log_softmax(-1)[0]
    assert lp.token_id == 1 and lp.rank == 1
    assert math.isclose(lp.logprob, ref[1].item(), rel_tol=1e-6)
    assert lp.top_token_ids == [1, 2]
    _, none = sample(logits, [WorkerSamplingParams(temperature=0)])
    assert none == [None]


def test_logprobs_of_some_rows_equal_the_whole_batch_computation(device):
    """Only the rows that ask are computed (and copied): on the CPU bit for bit what the
    whole batch's log_softmax gives them (as before rows were selected), on CUDA within
    1e-6 (its kernels promise no bitwise equality across batch shapes); others get None."""
    torch.manual_seed(3)
    logits = torch.randn(6, 2000, device=device) * 4
    asks = [None, 0, 3, None, 7, 1]
    params = [WorkerSamplingParams(temperature=0.9, seed=i, logprobs=k)
              for i, k in enumerate(asks)]
    gens = [make_generator(i, 0, 2000, device) for i in range(6)]
    tokens, lps = sample(logits, params, gens)
    full = logits.log_softmax(-1).cpu()
    for i, k in enumerate(asks):
        if k is None:
            assert lps[i] is None
            continue
        lp, row = lps[i], full[i]
        top_vals, top_ids = row.topk(k) if k else (row[:0], row[:0].long())
        assert lp.token_id == tokens[i].item() and lp.top_token_ids == top_ids.tolist()
        if device.type == "cpu":
            assert lp.logprob == row[lp.token_id].item()
            assert lp.rank == int((row > row[lp.token_id]).sum()) + 1
            assert lp.top_logprobs == top_vals.tolist()
        else:
            assert lp.logprob == pytest.approx(row[lp.token_id].item(), rel=1e-6, abs=1e-6)
            assert abs(lp.rank - (int((row > row[lp.token_id]).sum()) + 1)) <= 1
            assert lp.top_logprobs == pytest.approx(top_vals.tolist(), rel=1e-6, abs=1e-6)


def test_penalty_counts_are_built_on_the_logits_device(device):
    from worker.sampler import _token_counts
    counts = _token_counts([[1, 1, 4], [], [0, 4, 4, 4]], 5, device)
    assert counts.device.type == device.type
    assert counts.cpu().tolist() == [[0, 2, 0, 0, 1], [0] * 5, [1, 0, 0, 0, 3]]


def test_row_argmax_is_argmax_with_ties_to_the_first_index():
    from worker.sampler import row_argmax
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 1000, generator=g)
    x[3, [10, 500, 999]] = 100.0  # a tie: the first index wins
    x[7, 0] = x[7, 1] = float("inf")
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert row_argmax(x)[3] == 10 and row_argmax(x)[7] == 0
    for dtype in (torch.bfloat16, torch.float16):  # one 16-bit row: the native kernel
        row = x[3:4].to(dtype)
        assert row_argmax(row).tolist() == [10] == row.argmax(-1).tolist()


def test_runner_samples_argmax_only_rows_without_the_sampler():
    """A step of plain greedy rows takes each row's argmax straight from the logits;
    the sampler, which the other steps use, is never called."""
    from worker.model_runner import ModelRunner

    class Row:
        sampling_params = WorkerSamplingParams(temperature=0.0)
    runner = object.__new__(ModelRunner)
    runner.sampler = lambda *a: pytest.fail("the sampler ran for argmax-only rows")
    logits = torch.randn(3, 500).bfloat16()
    logits[1, 7] = logits[1, 9] = 50.0  # a tie: the first index wins
    tokens, logprobs = runner.sample([Row()] * 3, logits, argmax_only=True)
    assert tokens == logits.float().argmax(-1).tolist() and tokens[1] == 7
    assert logprobs == [None] * 3


@pytest.mark.parametrize("n", [1, 15, 16, 49152 + 7])
def test_native_row_argmax_matches_torch_with_nan_inf_and_ties(n):
    """The native kernel (vector maximum, then the first index holding it) against
    torch's max(-1).indices, tails past whole vectors and NaN rows included."""
    from kernels import cpu_extension
    if not cpu_extension.is_available():
        pytest.skip("native CPU kernels unavailable")
    ops = cpu_extension.require()
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g)
    x[1] = -float("inf")                      # all -inf: index 0
    x[2, -1] = float("inf")                   # the maximum in the tail
    x[3, n // 2] = x[3, -1] = 50.0            # a tie: the first wins
    x[4, -1] = float("nan")                   # a NaN is the largest
    x[5, n // 3] = x[5, n // 2] = float("nan")  # the first NaN
    x[6] = 0.0
    x[6, n - 1] = -0.0
    x[7, 0] = float("nan")
    assert torch.equal(ops.row_argmax(x), x.max(-1).indices)
    assert torch.equal(ops.row_argmax(x[:, : max(1, n // 2)]), x[:, : max(1, n // 2)].max(-1).indices)
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit rows: their float32 copy's index
        half = x.to(dtype)
        assert torch.equal(ops.row_argmax(half), half.float().max(-1).indices)
    with pytest.raises(RuntimeError, match="float32"):
        ops.row_argmax(x.double())


@pytest.mark.parametrize("change,expected", [
    ({}, True),
    ({"temperature": 0.7}, False),
    ({"logprobs": 0}, False),
    ({"repetition_penalty": 1.1}, False),
    ({"logit_bias_ids": (3,), "logit_bias_values": (1.0,)}, False),
    ({"min_tokens": 3, "stop_token_ids": (2,)}, False),   # 1 output so far: still banned
    ({"min_tokens": 1, "stop_token_ids": (2,)}, True),    # past it
    ({"top_k": 5, "top_p": 0.5}, True),                   # cuts do not move a greedy argmax
])
def test_takes_argmax_only_when_nothing_but_the_argmax_is_read(change, expected):
    """The runner then keeps the LM head's logits in the model's dtype (no float32 copy)."""
    from worker.sampling_metadata import takes_argmax_only
    plain = WorkerSamplingParams(temperature=0.0)
    params = [plain, WorkerSamplingParams(**{"temperature": 0.0, **change})]
    assert takes_argmax_only(params, [[7], [7]]) is expected
    md = SamplingMetadata.build(params, [None, None], [[1], [1]], [[7], [7]], (5,))
    if expected:  # build leaves every optional input empty: the sampler reads argmaxes
        assert md.all_greedy and md.logit_bias is None and not md.min_tokens_stop_ids
        assert md.max_num_logprobs is None and md.repetition_penalty is None
