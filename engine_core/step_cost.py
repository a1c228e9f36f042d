"""How long a step takes, learned from the steps run so far (``scheduler.max_step_ms``).

A step's wall time (plan sent to result applied) is modelled as linear in its shape:
a fixed cost, the prefill tokens, the decode tokens and the context the decodes attend
to. The weights are a least-squares fit over every step seen, each older step's weight
decaying by ``DECAY`` a step so the fit follows the machine's load; a small ridge
keeps the fit defined while the steps seen are all alike. It is then ambiguous
between the fixed cost and the per-token costs, and the ridge's split overprices the
fixed cost when the steps seen were long (their time is mostly tokens): the next
steps come out shorter than needed, and those, being different, resolve the fit.

The scheduler asks, before planning, how many prefill tokens fit the target beside the
decodes it will run anyway. That bounds every step, and so bounds how long a newcomer
waits for the step in flight before its own can start: with 2,048-token prefill chunks
a step takes over a second on a 2-core CPU. Under ``fcfs`` and ``priority`` decodes are
never cut (they are the running requests' progress); when they alone exceed the target,
prefills still get ``min_prefill_tokens`` a step so that waiting requests keep starting.
The ``fair`` planner may run only some of the decodes in a bounded step, round robin
(``decodes_within``; fair_step.py).
"""
from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.97       # weight of a step one step older (about the last 30 steps count)
MIN_STEPS = 4      # steps seen before any prediction
_RIDGE = 1e-3      # relative to the mean diagonal of the normal equations
SHORT_PROMPT_TOKENS = 256  # a prompt this short runs alone in about the fixed cost
SHORT_STEP_WEIGHT = 0.2    # weight of the newest such step in ``short_step_ms``


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, in the terms its time depends on."""

    num_prefill_tokens: int
    num_decode_tokens: int
    decode_context: int  # tokens the decodes attend to, summed over them
    # The step is one request's whole prompt (what the prefix cache did not hold) of
    # at most SHORT_PROMPT_TOKENS and nothing else: the step a newcomer's first token
    # takes when it runs alone (not a chunk of a long prompt, which may also run alone).
    is_short_prompt_alone: bool = False

    def features(self) -> tuple[float, float, float, float]:
        # scaled to be of order one at typical sizes, so the ridge treats them alike
        return (1.0, self.num_prefill_tokens / 1024, self.num_decode_tokens / 64,
                self.decode_context / 65536)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, by Gaussian elimination with partial pivoting (a is small)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        if m[r][r] != 0.0:
            x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class StepCost:
    """Predicts a step's time in ms from its shape; sizes prefill to a target."""

    def __init__(self) -> None:
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self._weights: list[float] | None = None  # None: refit before the next use
        self.num_steps = 0
        # The measured time of a short prompt's step alone (StepShape
        # .is_short_prompt_alone), a moving average; None until one ran. The fit's
        # fixed cost cannot stand in for it: a CPU decode-only step runs fused layers,
        # cheaper than the prefill path, and runs of alike steps leave the fit's split
        # between the fixed and the per-token costs to the ridge.
        self.short_step_ms: float | None = None

    def observe(self, shape: StepShape, elapsed_ms: float) -> None:
        """Add one step's measured time to the fit."""
        x = shape.features()
        for i in range(4):
            self._xty[i] = DECAY * self._xty[i] + x[i] * elapsed_ms
            row = self._xtx[i]
            for j in range(4):
                row[j] = DECAY * row[j] + x[i] * x[j]
        self.num_steps += 1
        self._weights = None
        if shape.is_short_prompt_alone:
            self.short_step_ms = elapsed_ms if self.short_step_ms is None else (
                (1 - SHORT_STEP_WEIGHT) * self.short_step_ms + SHORT_STEP_WEIGHT * elapsed_ms)

    def weights(self) -> list[float] | None:
        """Fitted ms per unit of each feature; None until ``MIN_STEPS`` steps."""
        if self.num_steps < MIN_STEPS:
            return None
        if self._weights is None:
            ridge = _RIDGE * sum(self._xtx[i][i] for i in range(4)) / 4
            a = [[v + (ridge if i == j else 0.0) for j, v in enumerate(row)]
                 for i, row in enumerate(self._xtx)]
            self._weights = _solve(a, self._xty)
        return self._weights

    def predict_ms(self, shape: StepShape) -> float | None:
        """The step's expected time; None while too few steps were seen."""
        w = self.weights()
        if w is None:
            return None
        return sum(wi * xi for wi, xi in zip(w, shape.features()))

    def prefill_tokens_within(self, max_step_ms: float, num_decode_tokens: int,
                              decode_context: int, min_prefill_tokens: int) -> int | None:
        """Prefill tokens a step with these decodes can add and still be predicted to
        take at most ``max_step_ms``, never under ``min_prefill_tokens``; None (no
        bound) while the fit is not ready or prices prefill tokens at nothing."""
        w = self.weights()
        if w is None or w[1] <= 0.0:
            return None
        base = self.predict_ms(StepShape(0, num_decode_tokens, decode_context))
        per_token = w[1] / 1024
        return max(min_prefill_tokens, int((max_step_ms - base) / per_token))

    def decodes_within(self, max_step_ms: float, contexts: list[int],
                       base_ms: float) -> int | None:
        """How many of the decodes with these ``contexts`` (in the order given) fit in
        ``max_step_ms`` beside a fixed cost of ``base_ms``, each priced at the fit's
        cost of one more decode: at least one; None (no bound) while the fit is not
        ready or prices decodes at nothing. The fit's own fixed cost is the least
        certain of its weights (module docstring), so the caller passes a measured one."""
        w = self.weights()
        if w is None or w[2] <= 0.0:
            return None
        per_decode, per_context = w[2] / 64, max(0.0, w[3]) / 65536
        total = base_ms
        for num, context in enumerate(contexts):
            total += per_decode + per_context * context
            if total > max_step_ms:
                return max(1, num)
        return len(contexts)
