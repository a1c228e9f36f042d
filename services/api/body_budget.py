"""The body budget: how many bytes of request bodies this API process holds at once.

Each request body is read into memory whole before it is parsed, so without a cap a
few hundred clients that each declare a 4 MiB body and send all but its last byte pin
gigabytes. Every read holds a :class:`BodyReservation` against one process-wide
``api.max_buffered_body_bytes``:

    Content-Length known   the whole length is reserved before a byte is read;
                           when it cannot be, 503 + Retry-After and the body is not read
    chunked                each chunk is reserved as it arrives; when one cannot be,
                           503 + Retry-After and the rest is not read

A reservation ends when the raw body has been parsed (or the request failed, timed
out or its client left), so ``num_bytes`` returns to 0 when no body is being read.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from aiohttp import web

from services.api.errors import RETRY_AFTER_S
from services.api.openai_protocol import APIError


def budget_full() -> APIError:
    return APIError(503, "the server is reading too many request bodies at once; retry "
                    "later", "service_unavailable", code="body_buffer_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class BodyBudget:
    """The bytes of request bodies held now, against the process-wide cap."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0  # reserved by bodies being read now
        self.num_refused = 0  # requests answered 503 because the budget was spent

    def check(self, num_bytes: int | None) -> None:
        """Raise the 503 if ``num_bytes`` more cannot be held now."""
        if num_bytes and self.num_bytes + num_bytes > self.max_bytes:
            self.num_refused += 1
            raise budget_full()

    def check_request(self, request: web.BaseRequest) -> None:
        """``check`` for a request's declared Content-Length (``Expect`` answers)."""
        self.check(request.content_length)

    @contextlib.contextmanager
    def reservation(self) -> Iterator["BodyReservation"]:
        """A reservation for one body, given back however the block ends."""
        held = BodyReservation(self)
        try:
            yield held
        finally:
            self.num_bytes -= held.num_bytes
            held.num_bytes = 0


class BodyReservation:
    """One body's share of the :class:`BodyBudget`; it only grows until released."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.num_bytes = 0

    def hold(self, total: int) -> None:
        """Hold ``total`` bytes in all for this body (503 when the budget cannot)."""
        extra = total - self.num_bytes
        if extra > 0:
            self.budget.check(extra)
            self.budget.num_bytes += extra
            self.num_bytes = total
