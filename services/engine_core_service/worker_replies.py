"""What the engine core waits for from its worker: a step's result or a control verb's
answer, each the next frame on the link (the worker answers one message at a time)."""
from __future__ import annotations

import asyncio


class WorkerFailure(RuntimeError):
    """The worker died, hung up or reported a failed step: the stack must stop."""


async def next_worker_reply(replies: asyncio.Queue, expected: type, what: str,
                            timeout_s: float, setting: str):
    """The next reply, of type ``expected``; WorkerFailure when the worker stays silent
    past ``timeout_s`` (``setting``: the YAML key that sets it), closed its link or
    answered something else."""
    try:
        reply = await asyncio.wait_for(replies.get(), timeout_s)
    except asyncio.TimeoutError:
        raise WorkerFailure(f"the worker did not finish {what} within {timeout_s:g}s "
                            f"({setting}): it is hung") from None
    if reply is None:
        raise WorkerFailure("the worker closed its link")
    if not isinstance(reply, expected):
        raise WorkerFailure(f"unexpected worker reply {type(reply).__name__}")
    return reply
