"""Where one step's time went (the worker's span and the benchmarks read it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTiming:
    """Where one step's time went: building the batch, the forward pass, sampling;
    ``draft_seconds``: the draft model proposing (speculative decoding)."""

    prepare_seconds: float = 0.0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
