"""The worker's structured outputs: grammar cache, per-sample matchers, step masks.

Matchers live here, in the worker, because this is where tokens are sampled: the mask
for step t+1 needs the token of step t, which the worker has at once, while the engine
core would see it one round trip later and would have to ship every mask back. The
worker also already holds per-request state across steps, replays a preempted
request's tokens (NewRequestData carries them) and, with speculative decoding, holds
the drafts to check. The engine core only learns which rows were deferred.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from engine_core.structured_outputs import GrammarSpec, StructuredOutputReport
from text.grammar_compiler import GrammarCompiler, GrammarError, allocate_bitmask
from text.tokenizer import Tokenizer
from worker.request_state import CachedRequestState
from worker.structured_output.grammar_cache import GrammarCache
from worker.structured_output.grammar_step import GrammarStep
from worker.structured_output.request_grammar import RequestGrammar


class StructuredOutputManager:
    """Grammars for one ModelRunner (``vocab_size``: its logits width).

    ``use_tokenizer`` must be called before a constrained request arrives (the model's
    bootstrap does); each step, ``begin_step`` before the forward and the returned
    GrammarStep's ``apply``/``accept`` around sampling.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.compiler: GrammarCompiler | None = None
        self.cache = GrammarCache(self._compile)
        self._mask_executor: ThreadPoolExecutor | None = None

    def use_tokenizer(self, tokenizer: Tokenizer | Callable[[], Tokenizer],
                      eos_token_ids: Sequence[int]) -> None:
        """Compile grammars against ``tokenizer`` (or what the loader gives, on the first
        grammar); ``eos_token_ids`` end an output."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.compiler = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)

    def _compile(self, spec: GrammarSpec):
        if self.compiler is None:
            raise GrammarError("this worker has no tokenizer to compile grammars with")
        return self.compiler.compile(spec)

    def validate(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` now (GrammarError if it does not) and keep it cached: the
        offline LLM checks a request this way before queuing it."""
        if spec in self.cache:
            future = self.cache.get(spec)
            error = future.exception() if future.done() else None
            if error is not None:
                raise error
            return
        t0 = time.perf_counter()
        template = self._compile(spec)
        self.cache.put(spec, template, time.perf_counter() - t0)

    def begin_step(self, states: list[CachedRequestState]) -> GrammarStep | None:
        """Start filling the masks of this step's constrained sampling states (``states``
        in logits order, each with its drafts set); None when none is constrained (then
        nothing is paid)."""
        positions = [i for i, s in enumerate(states) if s.sampling_params.grammar is not None]
        if not positions:
            return None
        grammars = [self._grammar_of(states[i]) for i in positions]
        drafts = [list(states[i].spec_token_ids) for i in positions]
        if self._mask_executor is None:
            self._mask_executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        num_rows = sum(len(d) + 1 for d in drafts)
        return GrammarStep(positions, grammars, drafts,
                           allocate_bitmask(num_rows, self.vocab_size), self._mask_executor)

    def _grammar_of(self, state: CachedRequestState) -> RequestGrammar:
        if state.grammar is None:  # first sample of this state: new, or resumed
            state.grammar = RequestGrammar(
                state.req_id, self.cache.get(state.sampling_params.grammar),
                state.output_token_ids, self.eos_token_ids)
        return state.grammar

    def take_report(self, step: GrammarStep | None) -> StructuredOutputReport | None:
        """What to tell the engine core about this step (None: nothing happened)."""
        compile_seconds, num_hits = self.cache.take_stats()
        deferred = step.deferred_req_ids if step is not None else []
        ended = step.ended_req_ids if step is not None else []
        if not (compile_seconds or num_hits or deferred or ended):
            return None
        return StructuredOutputReport(list(deferred), compile_seconds, num_hits, list(ended))

