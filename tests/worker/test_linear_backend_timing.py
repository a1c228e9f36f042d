"""The backend timing loop on scripted pass times: no kernel runs, so these test only the
rules (turns, dropping hopeless paths, the default's margin), deterministically."""
from __future__ import annotations

import pytest
import torch

from worker import linear_backend
from worker.models.linear_paths import ROW_BUCKETS


def scripted(monkeypatch, times: dict[str, dict[int, float]]):
    """Each pass of ``path`` at ``rows`` takes times[path][rows]; returns the call log."""
    calls = []

    def pass_seconds(path, x, weights):
        calls.append((path, x.shape[0]))
        return times[path][x.shape[0]]

    monkeypatch.setattr(linear_backend, "_pass_seconds", pass_seconds)
    return calls


def flat(value: float) -> dict[int, float]:
    return dict.fromkeys(ROW_BUCKETS, value)


def test_the_lead_is_kept_when_it_is_far_faster_than_at_fewer_rows(monkeypatch):
    # a burst of load made "a" look slow at 1 row; at 4 rows it is 10x faster than that:
    # "b" is dropped as hopeless, but "a" (the lead) must keep its time
    scripted(monkeypatch, {"a": {**flat(0.1), 1: 1.0}, "b": flat(0.5)})
    out = linear_backend.time_paths([torch.zeros(8, 32)], ("a", "b"), torch.float32)
    assert out["a"][1] == 0.1
    assert out["b"][1] is None
    assert linear_backend.fastest(out)[1] == "a"


def test_a_hopeless_path_stops_being_timed(monkeypatch):
    calls = scripted(monkeypatch, {"a": flat(1.0), "b": flat(10.0)})
    out = linear_backend.time_paths([torch.zeros(8, 32)], ("a", "b"), torch.float32)
    assert out["b"] == [None] * len(ROW_BUCKETS)
    assert calls.count(("b", 1)) == 2  # the warm-up call and one pass, then dropped
    assert all(("b", rows) not in calls for rows in ROW_BUCKETS[1:])  # floor: never again
    assert linear_backend.fastest(out) == ["a"] * len(ROW_BUCKETS)


def test_buckets_past_max_rows_repeat_the_last_measured(monkeypatch):
    calls = scripted(monkeypatch, {"a": flat(1.0), "b": flat(0.5)})
    out = linear_backend.time_paths([torch.zeros(8, 32)], ("a", "b"), torch.float32,
                                    max_rows=16)
    assert max(rows for _, rows in calls) == 16
    assert out["b"][-1] == out["b"][ROW_BUCKETS.index(16)] == 0.5


@pytest.mark.parametrize("other, expected", [(0.95, "a"), (0.85, "b")])
def test_the_default_is_kept_unless_beaten_by_the_margin(other, expected):
    n = len(ROW_BUCKETS)
    assert linear_backend.fastest({"a": [1.0] * n, "b": [other] * n}) == [expected] * n


def test_a_dropped_default_gives_way():
    n = len(ROW_BUCKETS)
    assert linear_backend.fastest({"a": [None] * n, "b": [2.0] * n}) == ["b"] * n


def test_a_slow_warm_up_call_alone_does_not_drop_a_path(monkeypatch):
    # "b"'s first call at 16 rows pays its first touches (10x); its passes are 2x faster
    # than "a": it must be timed on and chosen there
    seen = set()

    def pass_seconds(path, x, weights):
        rows = x.shape[0]
        if path == "a":
            return 1.0
        first = (path, rows) not in seen
        seen.add((path, rows))
        return 10.0 if first and rows == 16 else 0.5

    monkeypatch.setattr(linear_backend, "_pass_seconds", pass_seconds)
    out = linear_backend.time_paths([torch.zeros(8, 32)], ("a", "b"), torch.float32)
    assert out["b"][ROW_BUCKETS.index(16)] == 0.5
    assert linear_backend.fastest(out) == ["b"] * len(ROW_BUCKETS)
