"""What the model runner remembers about one request between steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_core.worker_sampling import WorkerSamplingParams

if TYPE_CHECKING:
    from worker.structured_output.request_grammar import RequestGrammar


@dataclass(slots=True)
class CachedRequestState:
    """Token ids (prompt then sampled), block table and progress of one request.

    The runner appends the tokens it samples itself, so the engine core never sends
    them back; ``num_computed_tokens`` counts the tokens whose K/V are in the cache.

    Speculative decoding: ``spec_token_ids`` are this step's drafts, computed after
    ``token_ids`` but not part of them until accepted; ``noise_rows`` are sampling noise
    rows a seeded request drew for positions it has not reached yet (its generator's
    stream stays one row per output token); ``num_draft_computed`` counts the tokens
    whose K/V the draft model holds.
    ``grammar`` is the sample's matcher once it first samples under a grammar.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: WorkerSamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    lora_id: int = 0  # the LoRA adapter it runs with; 0: the base model
    spec_token_ids: list[int] = field(default_factory=list)
    noise_rows: list[torch.Tensor] = field(default_factory=list)
    num_draft_computed: int = 0
    grammar: RequestGrammar | None = None

    def input_token_ids(self, start: int, num: int) -> list[int]:
        """Tokens ``start .. start+num-1`` of the known tokens followed by the drafts."""
        known = self.token_ids[start:start + num]
        if len(known) == num:
            return known
        offset = max(0, start - len(self.token_ids))
        return known + self.spec_token_ids[offset:offset + num - len(known)]

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]


def make_generator(seed: int | None, num_draws: int, vocab_size: int,
                   device: torch.device | str = "cpu") -> torch.Generator | None:
    """A request's own generator on ``device`` (where its logits are sampled),
    fast-forwarded past ``num_draws`` earlier samples.

    Each sampling step consumes one exponential draw per vocabulary entry, so a request
    resumed after preemption replays those draws and continues its random stream
    exactly where it stopped (a CUDA generator's stream differs from a CPU one's, so
    the same seed gives other tokens on another device type).
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device).manual_seed(seed)
    if num_draws:
        scratch = torch.empty(vocab_size, dtype=torch.float32, device=device)
        for _ in range(num_draws):
            scratch.exponential_(generator=gen)
    return gen
