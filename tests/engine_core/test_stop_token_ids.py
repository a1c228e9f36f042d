"""Issue 14, item 2: a huge ``stop_token_ids`` list costs a bounded amount, once.

The engine holds it as a frozenset (one O(1) lookup per sampled token), validates a
request's parameters once whatever ``n`` is, and refuses more ids than the vocabulary
holds, or ids outside it, naming ``stop_token_ids``.
"""
import time

import pytest

from engine_core.sampling_params import InvalidRequestError, SamplingParams
from tests.engine_core.factories import make_engine

VOCAB = 49152
# The fake executor only ever samples tokens below 97: none of these ids stops a request.
NEVER_SAMPLED = list(range(97, VOCAB))


def _engine():
    return make_engine(num_blocks=512, max_model_len=512, max_num_batched_tokens=64,
                       max_num_seqs=32, vocab_size=VOCAB)


def _seconds_per_decode_step(params: SamplingParams, num_steps: int = 60) -> float:
    engine = _engine()
    engine.add_request("r", list(range(8)), params)
    for _ in range(4):  # the prompt and the forks of its samples
        engine.step()
    t0 = time.perf_counter()
    for _ in range(num_steps):
        assert engine.step(), "every step samples a token for every sample"
    return (time.perf_counter() - t0) / num_steps


def test_a_vocabulary_of_stop_token_ids_costs_no_more_per_step():
    plain = SamplingParams(n=16, max_tokens=200, ignore_eos=True)
    huge = plain.clone(stop_token_ids=NEVER_SAMPLED)
    base = min(_seconds_per_decode_step(plain) for _ in range(3))
    with_ids = min(_seconds_per_decode_step(huge) for _ in range(3))
    # A list scanned per sampled token costs 16 x 49,055 comparisons per step (about
    # 30x a plain step); a set lookup costs what any other step costs.
    assert with_ids < 3 * base + 0.002, (with_ids, base)


def test_stop_token_ids_are_a_frozenset_shared_by_every_sample():
    engine = _engine()
    params = SamplingParams(n=16, max_tokens=4, stop_token_ids=NEVER_SAMPLED)
    assert isinstance(params.stop_token_ids, frozenset)
    ids = engine.add_request("r", [1, 2, 3], params)
    held = {id(engine.scheduler.requests[i].sampling_params.stop_token_ids) for i in ids}
    assert held == {id(params.stop_token_ids)}


def test_parameters_are_validated_once_per_request_not_per_sample(monkeypatch):
    params = SamplingParams(n=16, max_tokens=None, stop_token_ids=NEVER_SAMPLED)
    engine = _engine()
    calls = []
    validate = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate",
                        lambda self: (calls.append(1), validate(self))[1])
    engine.add_request("r", [1, 2, 3], params)
    assert len(calls) == 1
    # the samples' clones (n=1, seed + i, max_tokens filled in) are not revalidated
    assert all(r.sampling_params.max_tokens is not None
               for r in engine.scheduler.requests.values())


@pytest.mark.parametrize("ids", [list(range(VOCAB + 1)), [VOCAB], [0, 5, VOCAB + 7]],
                         ids=["more-than-the-vocabulary", "one-past-the-end", "one-outside"])
def test_stop_token_ids_beyond_the_vocabulary_are_refused(ids):
    engine = _engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("r", [1, 2], SamplingParams(stop_token_ids=ids))
    assert e.value.param == "stop_token_ids"
    assert not engine.has_unfinished_requests()


def test_a_vocabulary_sized_list_is_accepted_and_still_stops():
    engine = _engine()
    engine.add_request("r", [0, 1, 2], SamplingParams(max_tokens=8,
                                                      stop_token_ids=list(range(VOCAB))))
    outs = engine.step()
    assert outs[0].finished and outs[0].stop_reason == outs[0].new_token_ids[-1]


@pytest.mark.parametrize("bad", [[1, True], [1, 2.0], [-1], ["3"], [None]])
def test_stop_token_ids_must_be_non_negative_integers(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=bad)
    assert e.value.param == "stop_token_ids"
