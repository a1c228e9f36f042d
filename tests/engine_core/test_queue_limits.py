"""Backpressure: the admission rule of engine_core/queue_limits.py, and the waiting
queue's token count it reads."""
import pytest

from engine_core.queue_limits import AdmittedBatches, QueueLimits
from engine_core.request_queue import RequestQueue
from tests.engine_core.factories import make_engine, make_request


def test_free_slots_admit_anything_and_full_slots_queue_up_to_the_limit():
    limits = QueueLimits(max_num_seqs=4, max_num_queued_requests=2, max_num_queued_tokens=None)
    # running + waiting below max_num_seqs: a slot is free, even for a huge prompt
    assert limits.rejection(2, 1, 10, 100_000) is None
    assert limits.rejection(4, 0, 0, 5) is None  # first queued
    assert limits.rejection(4, 1, 5, 5) is None  # second queued
    refusal = limits.rejection(4, 2, 10, 5)
    assert refusal is not None and "max_num_queued_requests=2" in refusal
    assert limits.is_full(4, 2, 10) and not limits.is_full(4, 1, 5)
    # waiting requests that still have slots do not count as queued
    assert limits.num_queued(1, 4) == 1 and limits.rejection(1, 4, 0, 1) is None


def test_token_cap_applies_only_while_requests_wait():
    limits = QueueLimits(max_num_seqs=2, max_num_queued_requests=100, max_num_queued_tokens=50)
    assert limits.rejection(1, 0, 0, 500) is None  # a slot is free
    assert limits.rejection(2, 1, 40, 10) is None  # exactly at the cap
    refusal = limits.rejection(2, 1, 40, 11)
    assert refusal is not None and "max_num_queued_tokens=50" in refusal
    assert limits.is_full(2, 1, 50) and not limits.is_full(2, 1, 49)


def test_zero_queue_refuses_whenever_every_slot_is_taken():
    limits = QueueLimits(max_num_seqs=1, max_num_queued_requests=0)
    assert limits.rejection(0, 0, 0, 1) is None
    assert limits.rejection(1, 0, 0, 1) is not None


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_request_queue_counts_tokens_in_and_out(policy):
    queue = RequestQueue(policy)
    a, b, c = make_request("a", 5), make_request("b", 7), make_request("c", 3)
    queue.add(a)
    queue.add_front(b)
    queue.add(c)
    assert queue.num_tokens == 15
    queue.remove(b)
    assert queue.num_tokens == 8
    queue.pop()
    queue.pop()
    assert queue.num_tokens == 0 and not queue


def test_engine_applies_limits_only_when_asked():
    engine = make_engine(max_num_seqs=2)  # scheduler config defaults: 1024 queued
    engine.queue_limits = QueueLimits(max_num_seqs=2, max_num_queued_requests=1)
    for i in range(3):
        assert engine.queue_rejection(4) is None
        engine.add_request(f"r{i}", list(range(4)))
    assert engine.queue_rejection(4) is not None and engine.is_queue_full()
    engine.add_request("offline", list(range(4)))  # add_request itself never refuses
    assert engine.get_stats().num_waiting_tokens == 16
    engine.abort_request(["r1", "r2", "offline"])
    engine.step()
    assert not engine.is_queue_full() and engine.get_stats().num_waiting_tokens == 0


def test_a_multi_prompt_request_is_admitted_whole():
    engine = make_engine(max_num_seqs=1)
    engine.queue_limits = QueueLimits(max_num_seqs=1, max_num_queued_requests=1)
    engine.add_request("req-0", list(range(4)), batch_id="req")
    engine.add_request("other", list(range(4)))  # the queue's one place
    assert engine.queue_rejection(4) is not None
    # req's other prompts pass the full queue: one of its prompts is queued here
    assert engine.queue_rejection(4, batch_id="req") is None
    engine.add_request("req-1", list(range(4)), batch_id="req")
    assert engine.queue_rejection(4, batch_id="req") is None
    # a request none of whose prompts this engine queued gets no pass
    assert engine.queue_rejection(4, batch_id="new") is not None


def test_admitted_batches_keep_the_newest():
    batches = AdmittedBatches(capacity=2)
    batches.add(None)
    assert None not in batches
    for b in ("a", "b", "a", "c"):  # "a" again is the newest then; "b" the oldest
        batches.add(b)
    assert "a" in batches and "c" in batches and "b" not in batches
