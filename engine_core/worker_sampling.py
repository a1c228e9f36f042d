"""The sampling parameters the model runner reads: what travels to the worker.

SamplingParams is the user's whole request (stop strings, ``max_tokens``, ``n``,
priority...); most of it only matters to the engine core and the API process. The
worker gets this smaller value once per sample, in ``NewRequestData``, so a step frame
grows with the samples it admits, not with the size of their stop strings.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine_core.sampling_params import SamplingParams
from engine_core.structured_outputs import GrammarSpec


@dataclass(frozen=True, slots=True)
class WorkerSamplingParams:
    """One sample's sampler settings (worker/sampling_metadata.py reads every field).

    Built only from a validated SamplingParams (``from_params``), so the ranges hold.
    ``stop_token_ids`` are banned from the first ``min_tokens`` outputs, so they travel
    only when ``min_tokens > 0``; stopping on them is the engine core's job.
    ``grammar``: the output's grammar (worker/structured_output/), None when free.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # empty unless min_tokens > 0
    grammar: GrammarSpec | None = None
    prompt_logprobs: int | None = None  # top logprobs per prompt token; None: none
    logit_bias_ids: tuple[int, ...] = ()  # logit_bias as two columns: token ids ...
    logit_bias_values: tuple[float, ...] = ()  # ... and what is added to their logits

    @classmethod
    def from_params(cls, params: SamplingParams) -> "WorkerSamplingParams":
        """The worker's part of one sample's parameters."""
        banned = tuple(params.stop_token_ids) if params.min_tokens > 0 else ()
        so = params.structured_outputs
        return cls(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            min_p=params.min_p, seed=params.seed, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, logprobs=params.logprobs,
            min_tokens=params.min_tokens, ignore_eos=params.ignore_eos,
            stop_token_ids=banned, grammar=so.spec if so is not None else None,
            prompt_logprobs=params.prompt_logprobs,
            logit_bias_ids=tuple(params.logit_bias or ()),
            logit_bias_values=tuple(map(float, (params.logit_bias or {}).values())))

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
