"""Structured-output grammars compiled with llguidance against one tokenizer.

Why llguidance (measured on this project's 2-core EPYC): it needs no torch, compiles
ordinary schemas in 0.3-1 ms (a JSON schema, a regex, a choice, a GBNF grammar), fills
one row's token mask in 10-50 us, releases the GIL while it compiles and fills, and
bounds pathological inputs with :data:`LIMITS`. xgrammar pulled torch and transformers
at import, took 1.6-11 s on some ordinary-looking schemas with no way to bound it, and
silently ignored ``allOf``, ``uniqueItems``, ``not``, ``if``/``then``.

One :class:`GrammarCompiler` per tokenizer. The API process compiles each request's
grammar to validate it (services/api/grammar_check.py), the offline ``LLM`` and the
worker compile it to keep a template matcher (worker/structured_output/). The same
spec gives the same grammar everywhere: compact JSON (no free whitespace, which a small
model can loop on), ``\\d``/``\\w`` as ASCII (JSON Schema's regex semantics).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from engine_core.structured_outputs import GrammarSpec
from text.tokenizer import Tokenizer

_MAX_MESSAGE_CHARS = 300  # errors go back to clients: short, and never a parser dump


def parser_limits():
    """Bounds on what one grammar may cost (llguidance's ``LLParserLimits``): lexer
    fuel at build time and per token, Earley items per token, lexer states, grammar
    size. A grammar past them fails (a 400) or, mid-generation, stops with EOS."""
    import llguidance
    return llguidance.LLParserLimits(
        max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
        step_max_items=50_000, max_lexer_states=100_000, max_grammar_size=200_000,
        verbose_errors=False)


class GrammarError(ValueError):
    """A spec that does not compile; the message is short and safe to show a client."""

    def __init__(self, message: str):
        first = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
        super().__init__(first[:_MAX_MESSAGE_CHARS])


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec``; GrammarError when it cannot be built."""
    import llguidance
    matcher = llguidance.LLMatcher
    try:
        if spec.kind == "json":
            return matcher.grammar_from_json_schema(spec.text, defaults={
                "whitespace_flexible": False, "lenient": not spec.strict})
        if spec.kind == "regex":
            return matcher.grammar_from_lark(
                "start: /" + llguidance.regex_to_lark(spec.text, "dw") + "/")
        if spec.kind in ("choice", "grammar"):  # "grammar": GBNF/EBNF or Lark
            return llguidance.grammar_from(spec.kind, spec.text)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


class GrammarCompiler:
    """Compiles GrammarSpecs into llguidance template matchers for one tokenizer.

    ``vocab_size`` is the model's number of logits rows (it may exceed the tokenizer's
    vocabulary); ``eos_token_ids`` end the output once the grammar is complete. The
    llguidance tokenizer (0.2-0.5 s to build) is made on first use, once.
    """

    def __init__(self, tokenizer: Tokenizer | Callable[[], Tokenizer], vocab_size: int,
                 eos_token_ids: Sequence[int]):
        # a loader instead of a tokenizer: built on the first compile (the worker keeps
        # no ~20 MB tokenizer resident for grammars it may never see)
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Tokenizer:
        with self._lock:
            if not isinstance(self._tokenizer, Tokenizer):
                self._tokenizer = self._tokenizer()
            return self._tokenizer

    @property
    def ll_tokenizer(self):
        """The llguidance view of the tokenizer (built once, thread-safe)."""
        tokenizer = self.tokenizer
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec):
        """A template ``LLMatcher`` at the grammar's start, its first token mask computed
        and one step beyond it tried (so a grammar that fails on its first or second
        token fails here); GrammarError otherwise. Callers keep the template and
        ``deep_copy()`` it per sample."""
        import llguidance
        import llguidance.numpy as llnp
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(spec), log_level=0,
                                        limits=parser_limits())
        if not template.is_error():
            mask = allocate_bitmask(1, self.vocab_size)
            llnp.fill_next_token_bitmask(template, mask)
            if not template.is_error():
                self._try_first_token(template, mask)
        if template.is_error():
            raise GrammarError(template.get_error())
        return template

    def _try_first_token(self, template, mask: np.ndarray) -> None:
        """Consume the first token ``mask`` allows (EOS aside) on a copy and compute the
        next mask. A grammar whose lexer outgrows its limits on the first step (a regex
        like ``(a{1000}){1000}``) would otherwise pass here and only fail mid-generation,
        where the sample can just end."""
        import llguidance.numpy as llnp
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")
        eos = set(self.eos_token_ids)
        first = next((int(t) for t in np.flatnonzero(bits) if int(t) not in eos), None)
        if first is None:
            return
        probe = template.deep_copy()
        if probe.consume_tokens([first]):
            llnp.fill_next_token_bitmask(probe, allocate_bitmask(1, self.vocab_size))
        if probe.is_error():
            raise GrammarError(probe.get_error())


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """An int32 token bitmask ``[num_rows, ceil(vocab_size / 32)]``, every token allowed
    (bit ``t % 32`` of word ``t // 32`` is token t; llguidance's layout)."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)
