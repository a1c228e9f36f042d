"""Each request's grammar is compiled once in the API process before it may reach the
engine: one that does not compile, or not within ``api.grammar_compile_timeout_s``, is
a 400 naming the field that asked for it.

Compiles run on one thread of their own (llguidance releases the GIL while it builds),
never on the event loop and never on the tokenizer threads, so a slow grammar delays
only other grammars. That thread runs at a lower priority (as the long-text tokenizer
threads do): grammars built to compile for seconds each must not take a core from the
worker's forward passes. Verdicts are kept by spec
(LRU): a schema sent again costs a lookup. The time limit counts the compile's own CPU
seconds, so a grammar is not blamed for a busy machine; a request whose grammar waited
MAX_QUEUE_WAIT_S behind others' is told to retry (503), not blamed, and so is one whose
compile has not finished after MAX_WALL_FACTOR times the limit.
A compile that overruns cannot be stopped, but llguidance's limits
(text/grammar_compiler.py) bound how long it can go on.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from engine_core.structured_outputs import GrammarSpec
from services.api.openai_protocol import bad, unavailable
from services.api.tokenizer_pool import lower_thread_priority
from text.grammar_compiler import GrammarCompiler, GrammarError
from text.tokenizer import Tokenizer

MAX_VERDICTS = 1024
MAX_QUEUE_WAIT_S = 10.0  # behind other grammars; then 503 (retry), never a false 400
MAX_WALL_FACTOR = 10.0  # a compile starved of CPU this long: 503 (retry), not a 400
_POLL_S = 0.02


def _thread_cpu_clock() -> int | None:
    """The calling thread's CPU-time clock (Unix), None elsewhere."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


class _Compile:
    """One compile on the grammar thread: ``picked`` when the thread took it, ``started``
    when the compile itself began (after the one-time tokenizer build)."""

    def __init__(self, compiler: GrammarCompiler, spec: GrammarSpec):
        self.compiler, self.spec = compiler, spec
        self.picked: float | None = None
        self.started: float | None = None
        self._clock: int | None = None
        self._cpu_started = 0.0

    def run(self) -> str | None:
        self.picked = time.monotonic()
        self.compiler.ll_tokenizer  # built once per process, not counted against the limit
        self._clock = _thread_cpu_clock()
        if self._clock is not None:
            self._cpu_started = time.clock_gettime(self._clock)
        self.started = time.monotonic()
        try:
            self.compiler.compile(self.spec)
        except GrammarError as e:
            return str(e)
        return None

    def seconds(self) -> float:
        """How long the compile has run: its thread's CPU seconds where the platform
        tells them, else wall seconds (call once ``started`` is set)."""
        if self._clock is not None:
            try:
                return time.clock_gettime(self._clock) - self._cpu_started
            except OSError:  # the thread is gone: the compile has finished
                pass
        return time.monotonic() - self.started


class GrammarChecker:
    """Validates grammars by compiling them (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 timeout_s: float):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-check",
                                            initializer=lower_thread_priority)
        self._verdicts: OrderedDict[GrammarSpec, str | None] = OrderedDict()

    async def check(self, spec: GrammarSpec, param: str) -> bool:
        """Return whether the verdict was cached; raise a 400 naming ``param`` if the
        grammar does not compile in time, a 503 if it could not start in time."""
        if spec in self._verdicts:
            self._verdicts.move_to_end(spec)
            verdict = self._verdicts[spec]
            if verdict is not None:
                raise bad(f"'{param}': {verdict}", param)
            return True
        verdict = await self._compile(spec)
        self._verdicts[spec] = verdict
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)
        if verdict is not None:
            raise bad(f"'{param}': {verdict}", param)
        return False

    async def _compile(self, spec: GrammarSpec) -> str | None:
        job = _Compile(self.compiler, spec)
        future = asyncio.get_running_loop().run_in_executor(self._executor, job.run)
        queued_at = time.monotonic()
        while True:
            done, _ = await asyncio.wait({future}, timeout=_POLL_S)
            if done:
                return future.result()
            now = time.monotonic()
            if job.started is not None and job.seconds() > self.timeout_s:
                return (f"the grammar did not compile within {self.timeout_s:g} s; make "
                        f"it smaller or simpler")
            if (job.started is not None
                    and now - job.started > MAX_WALL_FACTOR * self.timeout_s):
                raise unavailable("the grammar compiler is busy; retry later",
                                  "grammar_compiler_busy")
            if job.picked is None and now - queued_at > MAX_QUEUE_WAIT_S:
                future.cancel()
                raise unavailable("the grammar compiler is busy; retry later",
                                  "grammar_compiler_busy")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
