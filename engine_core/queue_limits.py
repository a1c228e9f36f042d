"""Backpressure for served requests: how many may wait, and how much prompt they carry.

The engine core is the one authority (it sees the requests of every API process), so
the limit holds globally however many API processes there are. The offline LLM never
asks: it queues whatever it is given.

    in the engine:   running (≤ max_num_seqs)  +  waiting
    queued        =  max(0, running + waiting - max_num_seqs)
                     the requests that could not start even if the KV cache had room

A new request is refused when it could not start at once (every max_num_seqs slot is
taken or promised to a waiting request) and either ``queued`` has reached
``max_num_queued_requests`` or the waiting prompt tokens plus its own would pass
``max_num_queued_tokens``. So the engine never holds more than
``max_num_seqs + max_num_queued_requests`` requests, and a request that finds free
slots is never refused, whatever its size. The one exception: once one prompt of a
multi-prompt request is queued, its other prompts are too (AdmittedBatches), so a
request is admitted whole, as its n samples are; otherwise a request of more prompts
than the limits could never be admitted.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from config.schema import SchedulerConfig


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """The scheduler section's queue limits, and the admission rule above."""

    max_num_seqs: int
    max_num_queued_requests: int
    max_num_queued_tokens: int | None = None

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> "QueueLimits":
        return cls(config.max_num_seqs, config.max_num_queued_requests,
                   config.max_num_queued_tokens)

    def num_queued(self, num_running: int, num_waiting: int) -> int:
        """Requests beyond the max_num_seqs slots."""
        return max(0, num_running + num_waiting - self.max_num_seqs)

    def rejection(self, num_running: int, num_waiting: int, num_waiting_tokens: int,
                  num_new_tokens: int) -> str | None:
        """Why a request of ``num_new_tokens`` prompt tokens must wait outside (a
        message for the client), or None when it may be queued."""
        if num_running + num_waiting < self.max_num_seqs:
            return None  # it gets a slot at once
        queued = self.num_queued(num_running, num_waiting)
        if queued >= self.max_num_queued_requests:
            return (f"the server is at capacity: {queued} requests are queued "
                    f"(scheduler.max_num_queued_requests={self.max_num_queued_requests}); "
                    f"retry later")
        limit = self.max_num_queued_tokens
        if limit is not None and num_waiting_tokens + num_new_tokens > limit:
            return (f"the server is at capacity: {num_waiting_tokens} prompt tokens are "
                    f"queued and this request adds {num_new_tokens} "
                    f"(scheduler.max_num_queued_tokens={limit}); retry later")
        return None

    def is_full(self, num_running: int, num_waiting: int, num_waiting_tokens: int) -> bool:
        """Whether the next request would be refused even with a one-token prompt (API
        processes use this to refuse before tokenizing)."""
        return self.rejection(num_running, num_waiting, num_waiting_tokens, 1) is not None


class AdmittedBatches:
    """The multi-prompt requests (their ``batch_id``) of which this engine has queued a
    prompt: the newest ``capacity`` of them, which covers a request's prompts arriving
    together. Their other prompts pass the queue limits."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, batch_id: str | None) -> bool:
        return batch_id is not None and batch_id in self._ids

    def add(self, batch_id: str | None) -> None:
        if batch_id is None:
            return
        self._ids[batch_id] = None
        self._ids.move_to_end(batch_id)
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
