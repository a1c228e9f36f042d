"""What a request asks its output to match: vLLM's ``structured_outputs`` fields.

:class:`StructuredOutputsParams` is the user's side (one of a JSON schema, a regex, a
list of choices, an EBNF/GBNF or Lark grammar, or "any JSON object"), checked for shape
on construction; compiling it is the grammar backend's job (text/grammar_compiler.py),
done by the API process (or the offline ``LLM``) before the request is queued, and again
by the worker, which holds the matchers (worker/structured_output/).

:class:`GrammarSpec` is what travels to the worker: one kind and one canonical text,
hashable, so equal specs share one compiled grammar there (the grammar cache's key).
No grammar library is imported here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from config.request_bounds import ENGINE_MAX_GRAMMAR_CHARS

ANY_JSON_OBJECT = '{"type": "object"}'


class StructuredOutputError(ValueError):
    """A structured-output field is malformed (``field`` names which one)."""

    def __init__(self, message: str, field_name: str):
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One grammar, as the worker compiles and caches it.

    ``kind`` is "json" (``text`` a JSON schema), "regex", "choice" (``text`` a JSON list
    of strings) or "grammar" (EBNF/GBNF or Lark). ``strict`` (JSON only): a schema
    keyword the backend cannot enforce is an error; without it the keyword is ignored.
    """

    kind: str
    text: str
    strict: bool = True


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema: a dict, or its JSON text), ``regex``,
    ``choice`` (non-empty strings), ``grammar`` (EBNF/GBNF or Lark) or ``json_object``
    (any JSON object) -- vLLM's ``StructuredOutputsParams``.

    A dict schema is stored as its JSON text (key order kept: it is the order the
    output's properties follow). ``strict=False`` ignores schema keywords the backend
    cannot enforce instead of refusing the schema.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise StructuredOutputError("json_object must be a boolean", "json_object")
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + ["json_object"] * bool(self.json_object)
        if len(given) != 1:
            raise StructuredOutputError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}", given[1] if given[1:] else "json")
        if not isinstance(self.strict, bool):
            raise StructuredOutputError("strict must be a boolean", "strict")
        kind = given[0]
        if kind == "json":  # normalised in place: what travels is the schema's text
            object.__setattr__(self, "json", _schema_text(self.json))
        elif kind == "choice":
            choices = _choices(self.choice)
            _bounded(json.dumps(list(choices)), "choice")
            object.__setattr__(self, "choice", choices)
        elif kind != "json_object":
            value = getattr(self, kind)
            if not isinstance(value, str) or not value.strip():
                raise StructuredOutputError(f"{kind} must be a non-empty string", kind)
            _bounded(value, kind)

    @property
    def spec(self) -> GrammarSpec:
        """The grammar the worker compiles (the grammar cache's key)."""
        if self.json_object:
            return GrammarSpec("json", ANY_JSON_OBJECT)
        if self.json is not None:
            return GrammarSpec("json", self.json, self.strict)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(list(self.choice)))
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        return GrammarSpec("grammar", self.grammar)

    @property
    def kind(self) -> str:
        """Which field was given: "json", "regex", "choice", "grammar" or "json_object"."""
        return "json_object" if self.json_object else self.spec.kind


def _bounded(text: str, name: str) -> str:
    if len(text) > ENGINE_MAX_GRAMMAR_CHARS:
        raise StructuredOutputError(f"{name} holds {len(text)} characters, more than the "
                                    f"engine's {ENGINE_MAX_GRAMMAR_CHARS}", name)
    return text


def _schema_text(schema: object) -> str:
    """A JSON schema (a dict, or its text) as JSON text that parses to an object."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(_bounded(schema, "json"))
        except ValueError:
            raise StructuredOutputError("json must be a JSON schema: an object, or its "
                                        "JSON text", "json") from None
        if not isinstance(parsed, dict):
            raise StructuredOutputError("json must be a JSON schema object", "json")
        return schema
    if not isinstance(schema, dict):
        raise StructuredOutputError("json must be a JSON schema: an object, or its JSON "
                                    "text", "json")
    try:
        return _bounded(json.dumps(schema, allow_nan=False), "json")
    except (TypeError, ValueError):
        raise StructuredOutputError("json must be a JSON-serialisable schema without NaN "
                                    "or infinities", "json") from None


def _choices(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
        raise StructuredOutputError("choice must be a list of strings", "choice")
    if not choice:
        raise StructuredOutputError("choice must hold at least one string", "choice")
    if not all(isinstance(c, str) and c for c in choice):
        raise StructuredOutputError("choice must hold non-empty strings", "choice")
    return tuple(choice)


@dataclass(slots=True)
class StructuredOutputReport:
    """What the worker's grammars did in one step (travels in ModelRunnerOutput).

    ``deferred_req_ids`` reached their first constrained token while their grammar was
    still compiling: they sampled nothing, and the scheduler gives back that step's
    last token so they compute it again next step (others in the batch went on).
    ``compile_seconds`` has one entry per grammar compiled since the last report (cache
    misses); ``num_cache_hits`` counts requests whose grammar was already compiled.
    ``ended_req_ids`` sampled an EOS where their grammar allowed nothing else: that EOS
    ends them even under ``ignore_eos`` or before ``min_tokens``.
    """

    deferred_req_ids: list[str] = field(default_factory=list)
    compile_seconds: list[float] = field(default_factory=list)
    num_cache_hits: int = 0
    ended_req_ids: list[str] = field(default_factory=list)
