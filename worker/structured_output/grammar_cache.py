"""Compiled grammars by spec: each compiled once, off the step loop, and kept (LRU).

A compile runs on the cache's own thread (llguidance releases the GIL while it builds
a grammar), so the step that first needs a grammar does not wait for it: the request
is deferred until its future is done (worker/structured_output/grammar_step.py). What
is cached is a template matcher at the grammar's start; every sample takes its own
``deep_copy()`` (about a microsecond), so one compile serves any number of requests.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from engine_core.structured_outputs import GrammarSpec

DEFAULT_MAX_ENTRIES = 256


class GrammarCache:
    """Template matchers keyed by GrammarSpec; ``get`` returns a Future of one.

    ``compile`` builds a template (or raises; the Future then holds the error, cached
    like a success so a bad grammar is not recompiled for each of its samples). Past
    ``max_entries`` the least recently used finished entries are dropped; samples that
    copied a template keep their copy.
    """

    def __init__(self, compile: Callable[[GrammarSpec], object],
                 max_entries: int = DEFAULT_MAX_ENTRIES):
        self._compile = compile
        self.max_entries = max_entries
        self._entries: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # guards the stats the compile thread appends to
        self._compile_seconds: list[float] = []
        self._num_hits = 0

    def get(self, spec: GrammarSpec) -> Future:
        """The template for ``spec``: cached, being compiled, or compiling from now."""
        future = self._entries.get(spec)
        if future is not None:
            self._entries.move_to_end(spec)
            with self._lock:
                self._num_hits += 1
            return future
        future = self._executor.submit(self._timed_compile, spec)
        self._entries[spec] = future
        self._evict()
        return future

    def put(self, spec: GrammarSpec, template: object, seconds: float) -> None:
        """Store a template compiled elsewhere (the offline LLM validates by compiling)."""
        future: Future = Future()
        future.set_result(template)
        self._entries[spec] = future
        self._entries.move_to_end(spec)
        with self._lock:
            self._compile_seconds.append(seconds)
        self._evict()

    def __contains__(self, spec: GrammarSpec) -> bool:
        return spec in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def take_stats(self) -> tuple[list[float], int]:
        """(seconds of each compile finished, cache hits) since the previous call."""
        with self._lock:
            stats = (self._compile_seconds, self._num_hits)
            self._compile_seconds, self._num_hits = [], 0
        return stats

    def _timed_compile(self, spec: GrammarSpec) -> object:
        t0 = time.perf_counter()
        try:
            return self._compile(spec)
        finally:
            with self._lock:
                self._compile_seconds.append(time.perf_counter() - t0)

    def _evict(self) -> None:
        # Oldest first; an entry still compiling is kept (its requests wait on it).
        for spec in list(self._entries):
            if len(self._entries) <= self.max_entries:
                return
            if self._entries[spec].done():
                del self._entries[spec]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
