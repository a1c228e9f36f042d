"""Per-step sampling inputs, gathered into tensors once for the whole batch, on the
device that holds the step's logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.worker_sampling import WorkerSamplingParams


@dataclass(slots=True)
class SamplingMetadata:
    """Row i of every tensor belongs to the i-th request that samples this step.

    Optional tensors are None when no row needs them, so the common case (plain
    temperature sampling or greedy) skips that work entirely.
    """

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    top_p: torch.Tensor | None  # [B] float32, 1 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    generators: dict[int, torch.Generator]  # row → a seeded request's, on the device
    presence_penalty: torch.Tensor | None  # [B]
    frequency_penalty: torch.Tensor | None  # [B]
    repetition_penalty: torch.Tensor | None  # [B]
    output_token_ids: list[list[int]] | None  # per row, when penalties apply
    prompt_token_ids: list[list[int]] | None  # per row, for the repetition penalty
    min_tokens_stop_ids: dict[int, list[int]]  # row → token ids banned until min_tokens
    max_num_logprobs: int | None  # most top logprobs any row asked for
    num_logprobs: list[int | None]  # per row
    # logit_bias of the rows that have one: (rows, token ids, biases), one entry per pair
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, params: list[WorkerSamplingParams],
              generators: list[torch.Generator | None],
              prompt_ids: list[list[int]], output_ids: list[list[int]],
              eos_token_ids: tuple[int, ...],
              device: torch.device | str = "cpu") -> "SamplingMetadata":
        """Gather the rows' parameters; ``output_ids[i]`` are the tokens sampled so far.

        Tensors go to ``device``; ``generators`` must already live there."""
        temps = [p.temperature for p in params]
        any_penalty = any(p.has_penalties for p in params)
        min_tokens_stop_ids = {}
        for i, p in enumerate(params):
            if len(output_ids[i]) < p.min_tokens:
                banned = list(p.stop_token_ids)
                if not p.ignore_eos:
                    banned += list(eos_token_ids)
                if banned:
                    min_tokens_stop_ids[i] = banned
        num_logprobs = [p.logprobs for p in params]
        wanted = [n for n in num_logprobs if n is not None]

        def column(attr, off, dtype=torch.float32):
            values = [getattr(p, attr) for p in params]
            return None if all(v == off for v in values) else torch.tensor(
                values, dtype=dtype, device=device)

        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            all_greedy=all(t == 0.0 for t in temps),
            top_k=column("top_k", 0, torch.int64),
            top_p=column("top_p", 1.0),
            min_p=column("min_p", 0.0),
            generators={i: g for i, g in enumerate(generators) if g is not None},
            presence_penalty=column("presence_penalty", 0.0),
            frequency_penalty=column("frequency_penalty", 0.0),
            repetition_penalty=column("repetition_penalty", 1.0),
            output_token_ids=output_ids if any_penalty else None,
            prompt_token_ids=prompt_ids if any_penalty else None,
            min_tokens_stop_ids=min_tokens_stop_ids,
            max_num_logprobs=max(wanted) if wanted else None,
            num_logprobs=num_logprobs,
            logit_bias=_logit_bias(params, device),
        )


def _logit_bias(params: list[WorkerSamplingParams],
                device: torch.device | str) -> tuple[torch.Tensor, ...] | None:
    """Every row's (token id, bias) pairs as three flat tensors, for one index_put_."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        rows += [i] * len(p.logit_bias_ids)
        ids += p.logit_bias_ids
        values += p.logit_bias_values
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def takes_argmax_only(params: list[WorkerSamplingParams],
                      output_ids: list[list[int]]) -> bool:
    """Whether every row's token is the plain argmax of its raw logits: greedy, with no
    penalty, bias, min_tokens ban or logprobs to compute (SamplingMetadata.build would
    leave every optional field empty)."""
    return all(p.temperature == 0.0 and not p.has_penalties and p.logprobs is None
               and not p.logit_bias_ids and len(out) >= p.min_tokens and p.grammar is None
               for p, out in zip(params, output_ids))
