"""How many drafts each request verifies next: adaptive speculation.

Each request keeps decayed counts of the draft positions it tested and of those
accepted. Their ratio ``alpha`` estimates the chance that a draft is right given that
the ones before it were, so the i-th draft of a step survives with probability about
``alpha ** i``. A draft costs one more token row in the verifying forward; it is worth
that while it is likely enough to be accepted, so a step verifies

    k = the largest k <= k_max with alpha ** k >= MIN_ACCEPT_PROB

(alpha 0.9 → k_max for k_max 5, 0.5 → 2, 0.3 → 1, below 0.2 → 0). Copy-heavy requests
climb to k_max within two steps; free-form ones fall to k = 0 and cost nothing. At
k = 0 a request still probes with one draft every PROBE_INTERVAL steps, so k grows
back when its drafts start to hit; with many requests running the interval stretches
to twice their number, so that probes add half a token row to a step on average. Counts decay by DECAY per verified step, so the
estimate follows a request whose text changes character (a quote, then commentary).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_ACCEPT_PROB = 0.2
DECAY = 0.7
PROBE_INTERVAL = 8
# The prior, worth two tested drafts: alpha 0.3 (k = 1), so a request earns longer
# runs (two accepted steps take a copying request to k = 5) and a free-form one
# wastes little before its estimate falls.
PRIOR_ACCEPTED, PRIOR_TESTED = 0.6, 2.0


@dataclass(slots=True)
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED
    tested: float = PRIOR_TESTED
    num_idle_steps: int = 0  # steps at k = 0 since the last probe

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested if self.tested > 0 else 0.0


class DraftLength:
    """Per-request k: always ``max_k`` when not adaptive, else as the module says."""

    def __init__(self, max_k: int, is_adaptive: bool = True):
        self.max_k = max_k
        self.is_adaptive = is_adaptive
        self._requests: dict[str, _Acceptance] = {}

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def alpha(self, req_id: str) -> float:
        """The current acceptance estimate of ``req_id`` (the prior if it has none)."""
        return self._requests.get(req_id, _Acceptance()).alpha

    def next_k(self, req_id: str, num_running: int = 1) -> int:
        """Drafts ``req_id`` should verify in the step being planned, with
        ``num_running`` requests running."""
        if not self.is_adaptive:
            return self.max_k
        state = self._requests.setdefault(req_id, _Acceptance())
        k = k_for_alpha(state.alpha, self.max_k)
        if k > 0:
            state.num_idle_steps = 0
            return k
        state.num_idle_steps += 1
        if state.num_idle_steps >= max(PROBE_INTERVAL, 2 * num_running):
            state.num_idle_steps = 0
            return 1
        return 0

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified step: ``num_accepted`` of ``num_drafts`` drafts were accepted.

        Positions tested: the accepted ones plus the first rejected one, if any (the
        drafts after it were never judged on their own)."""
        if not self.is_adaptive or num_drafts <= 0:
            return
        state = self._requests.setdefault(req_id, _Acceptance())
        tested = num_accepted + (1 if num_accepted < num_drafts else 0)
        state.accepted = DECAY * state.accepted + num_accepted
        state.tested = DECAY * state.tested + tested


def k_for_alpha(alpha: float, max_k: int) -> int:
    """The largest k <= max_k with alpha ** k >= MIN_ACCEPT_PROB (0 if none)."""
    if alpha >= 1.0:
        return max_k
    if alpha < MIN_ACCEPT_PROB:
        return 0
    return min(max_k, int(math.log(MIN_ACCEPT_PROB) / math.log(alpha) + 1e-9))
