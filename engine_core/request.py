"""One generation request as the engine core tracks it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine_core.outputs import FinishReason, TokenLogprobs
from engine_core.sampling_params import SamplingParams
from engine_core.worker_sampling import WorkerSamplingParams


# Whose quota a request counts against under the fair policy; None is the anonymous
# tenant, a tenant like any other.
Tenant = str | None


class RequestStatus(enum.Enum):
    """Where a request is in its life.

    ``WAITING_FOR_FORK`` marks samples 1..n-1 of an n > 1 request: they hold no
    blocks and sit outside the waiting queue until sample 0 has computed the prompt.
    ``WAITING_FOR_LORA``: parked outside the waiting queue until its LoRA adapter is
    loaded (engine_core/lora_admission.py).
    """

    WAITING = "waiting"
    WAITING_FOR_FORK = "waiting_for_fork"
    WAITING_FOR_LORA = "waiting_for_lora"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The OpenAI finish reason of a finished status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(slots=True, eq=False)
class Request:
    """A prompt, its sampling parameters and its progress.

    Progress is one counter: ``num_computed_tokens`` is how many of ``all_token_ids``
    have their K/V in the cache. The scheduler grants tokens each step until it
    catches up with ``num_tokens``; a sampled token then extends ``num_tokens``.

    ``num_cached_tokens`` is -1 until the first schedule; then it holds the prompt
    tokens this request did not compute itself (prefix-cache hits, or the prefix a
    forked sample shares with its sibling).

    ``tenant`` names whose quota the request counts against under the ``fair`` policy
    (None is the anonymous tenant, a tenant like any other); ``tenant_weight`` is that
    tenant's weight, as the API resolved it when the request arrived.

    Compared by identity (``eq=False``): two requests are never "equal".
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    lora_id: int = 0
    parent_req_id: str | None = None
    index: int = 0
    tenant: Tenant = None
    tenant_weight: float = 1.0
    priority: int = field(init=False)
    # What the worker needs of sampling_params; built once, sent with NewRequestData.
    worker_params: WorkerSamplingParams = field(init=False, repr=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=-1, init=False)
    num_preemptions: int = field(default=0, init=False)
    # prompt_logprobs set: prompt tokens 1.. computed so far, sent with the first output
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list, init=False)
    # Chained hashes of the full blocks of all_token_ids, grown by block_hash.py.
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    stop_reason: int | str | None = field(default=None, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    # Tie-break among equal arrival times, assigned by the scheduler (add order).
    arrival_seq: int = field(default=0, init=False)
    # prompt + outputs, kept in step with output_token_ids so reads never copy.
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.priority = self.sampling_params.priority
        self.worker_params = WorkerSamplingParams.from_params(self.sampling_params)
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. A live view: callers must not mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def is_decoding(self) -> bool:
        """At most one token left to compute: its next grant is a decode."""
        return len(self._all_token_ids) - self.num_computed_tokens <= 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output limit; the engine fills ``None`` in before the request is added."""
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is None:
            raise ValueError(f"request {self.req_id}: max_tokens was never filled in")
        return max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt token must be computed here (no prefix-cache hit) and its
        logprob kept until the first output."""
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Record sampled tokens (they are then known but not yet computed)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
