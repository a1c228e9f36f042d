"""``Expect: 100-continue``: the client waits before sending its body; the server says
whether the body is wanted.

aiohttp runs a route's expect handler as soon as the headers arrive, before any
middleware, and its default answers ``100 Continue`` at once, so a client would upload
megabytes only to be told 401, 413 or 503. This handler first runs the very checks the
middlewares and the body reader will run, in their order:

    auth (401) → admission (503 draining or queue full) → Content-Length (413)
    → body budget (503)

and sends ``100 Continue`` only when every one passes. Otherwise the final answer goes
at once, as errors.py shapes it, and the connection closes with its body never read.
Another expectation gets 417; an HTTP/1.0 request's Expect is ignored (RFC 9110).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from aiohttp import web
from aiohttp.http import HttpVersion11

from services.api.errors import error_response
from services.api.openai_protocol import APIError

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class ExpectContinue:
    """The expect handler of every route: ``checks`` each raise the error a request
    gets, if any (the same functions the middlewares and the body reader call)."""

    def __init__(self, checks: Sequence[Callable[[web.BaseRequest], None]]):
        self.checks = tuple(checks)

    async def handle(self, request: web.Request) -> web.StreamResponse | None:
        """None after sending ``100 Continue``; else the final answer."""
        if request.version != HttpVersion11:
            return None
        if request.headers.get("Expect", "").strip().lower() != "100-continue":
            return error_response(request, APIError(
                417, "the only expectation supported is 'Expect: 100-continue'",
                code="expectation_failed"))
        try:
            for check in self.checks:
                check(request)
        except Exception as e:
            resp = error_response(request, e)
            if resp is None:
                raise  # a bug: the connection handler answers a bare 500
            return resp
        await request.writer.write(CONTINUE)
        request.writer.output_size = 0  # an interim answer: an error may still follow
        return None
