"""One sample's grammar state in the worker: its own matcher, advanced token by token.

    template (GrammarCache) ──deep_copy──▶ matcher ──replay outputs──▶ ready
                                                    (a request resumed after preemption
                                                     has tokens already; a new one none)
Invariant: the matcher has consumed exactly the sample's output tokens, so its next
mask is the set of tokens the grammar allows now (EOS only once it is complete). A
token the mask did not allow is never given to it: llguidance would enter a permanent
error state. Should that happen anyway (or the grammar fail to compile, or exceed its
limits mid-way), the sample is ``failed`` and its mask allows only EOS: it ends.

EOS is never given to the matcher: llguidance records it only when the matcher has
not already stopped, so its rollback counts would depend on that. For the grammar an
EOS is a no-op (an output ends at it unless ``ignore_eos``; then the same mask holds
after it, with drafts or without). The exception: an EOS sampled where the grammar
allowed only EOS (complete and unable to go on, or failed) ends the output even under
``ignore_eos``, which would otherwise fill it with hidden EOS tokens up to max_tokens;
``accept`` says so and the engine core ends the sample.

Speculative decoding: ``fill_drafts`` writes the masks of the k+1 verified positions
by advancing through the drafts the grammar allows and rolling back, so the matcher
is where it began; after verification ``accept`` takes exactly the emitted tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from observability.logging import get_logger

log = get_logger(__name__)


def allow_only(bitmask: np.ndarray, row: int, token_ids: Sequence[int]) -> None:
    """Row ``row`` of an int32 token bitmask allows exactly ``token_ids``."""
    words = bitmask[row].view(np.uint32)
    words[:] = 0
    for t in token_ids:
        words[t // 32] |= np.uint32(1 << (t % 32))


def is_allowed(bitmask: np.ndarray, row: int, token_id: int) -> bool:
    """Whether row ``row`` of an int32 token bitmask allows ``token_id``."""
    word = int(bitmask[row, token_id // 32]) & 0xFFFFFFFF
    return bool(word >> (token_id % 32) & 1)


class RequestGrammar:
    """The matcher of one sample (see the module docstring)."""

    def __init__(self, req_id: str, template: Future, output_token_ids: Sequence[int],
                 eos_token_ids: Sequence[int]):
        self.req_id = req_id
        self._template = template
        self.eos_token_ids = tuple(eos_token_ids)
        self._replay = [t for t in output_token_ids if t not in self.eos_token_ids]
        self.matcher = None
        self.failed = False
        self.ended_at_eos = False  # see accept

    @property
    def is_ready(self) -> bool:
        """Whether the grammar is compiled (or failed); makes the matcher on first call
        after the compile finished. Never blocks."""
        if self.matcher is not None or self.failed:
            return True
        if not self._template.done():
            return False
        try:
            self.matcher = self._template.result().deep_copy()
        except Exception as e:  # the compile failed: the sample can only end
            self._fail(f"grammar did not compile: {e}")
            return True
        if self._replay and not self.matcher.consume_tokens(self._replay):
            self._fail("replaying the sample's tokens failed")
        self._replay = []
        return True

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (call once ready)."""
        if self.failed or self.matcher is None:
            allow_only(bitmask, row, self.eos_token_ids)
            return
        import llguidance.numpy as llnp
        llnp.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_error():  # a limit crossed mid-way: llguidance allows EOS only
            self._fail(self.matcher.get_error())

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance by sampled tokens the masks allowed (EOS skipped, see the module
        docstring); False (and failed) otherwise. Sets ``ended_at_eos`` when the first EOS
        among them was sampled where the grammar allowed nothing else (it is stopped, or
        failed): the output can only end there, even under ``ignore_eos``; tokens after
        that EOS are not consumed (the engine core drops them)."""
        self.ended_at_eos = False
        if self.failed or self.matcher is None:
            self.ended_at_eos = any(t in self.eos_token_ids for t in token_ids)
            return False
        run: list[int] = []
        seen_eos = False
        for t in token_ids:
            if t not in self.eos_token_ids:
                run.append(t)
                continue
            if not self._consume(run):
                return False
            run = []
            # only the first EOS: the engine core ends the sample at the first one, and
            # after an EOS where the grammar could go on (drafts past it under
            # ignore_eos) the next step's EOS ends it instead
            if not seen_eos and self.matcher.is_stopped():
                self.ended_at_eos = True
                return True
            seen_eos = True
        return self._consume(run)

    def _consume(self, token_ids: list[int]) -> bool:
        if token_ids and not self.matcher.consume_tokens(token_ids):
            self._fail(self.matcher.get_error())
            return False
        return True

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts now (the matcher stays)."""
        if self.failed or self.matcher is None:
            return 0
        return self.matcher.validate_tokens(list(token_ids))

    def fill_drafts(self, bitmask: np.ndarray, row: int, draft_ids: Sequence[int]) -> int:
        """Speculative decoding: the masks of the next ``len(draft_ids) + 1`` positions
        into rows ``row``, ``row + 1``, ... and how many leading drafts they allow::

            bitmask row   row      row+1    ...  row+a        row+a+1 ...
            matcher at    now      +d1      ...  +d1..da      (left as they are)
            judges        d1       d2       ...  d(a+1): banned

        Row ``row + i`` judges draft i+1 (and yields the token after d1..di), so the
        first draft the grammar rejects is banned by its own row and the verifier
        stops there: rows past it are never sampled from. The matcher ends where it
        began (it is rolled back over the drafts it consumed).
        """
        self.fill(bitmask, row)
        num_valid = num_consumed = 0
        for i, token in enumerate(draft_ids):
            if self.failed or not is_allowed(bitmask, row + i, token):
                break
            if token not in self.eos_token_ids:
                if not self.matcher.consume_token(token):
                    self._fail(self.matcher.get_error())
                    break
                num_consumed += 1
            num_valid += 1
            self.fill(bitmask, row + 1 + i)
        self.rollback(num_consumed)
        return num_valid

    def advance_draft(self, token_id: int) -> bool:
        """Consume a draft if the grammar allows it here (never failing the sample);
        whether it was consumed (EOS never is). ``rollback`` undoes it."""
        if (self.failed or self.matcher is None or token_id in self.eos_token_ids
                or self.matcher.validate_tokens([token_id]) != 1):
            return False
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens and self.matcher is not None and not self.failed:
            self.matcher.rollback(num_tokens)

    @property
    def is_complete(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        return self.matcher is not None and not self.failed and self.matcher.is_accepting()

    def _fail(self, why: str) -> None:
        if not self.failed:
            log.warning("structured output ends early", request_id=self.req_id,
                        reason=why.strip().splitlines()[0][:200] if why.strip() else "")
        self.failed = True
