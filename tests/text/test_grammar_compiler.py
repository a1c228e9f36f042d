"""Issue 17: each kind of spec compiles with llguidance against SmolLM2's tokenizer into a
matcher that accepts exactly its language; bad specs fail with a short message;
pathological ones are cut off by the parser limits rather than running unbounded."""
import json

import pytest

from engine_core.structured_outputs import GrammarSpec, StructuredOutputsParams
from text.grammar_compiler import GrammarCompiler, GrammarError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def compiler(smollm_tokenizer):
    return GrammarCompiler(smollm_tokenizer, 49152, smollm_tokenizer.eos_token_ids)


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` (SmolLM2's own tokens) is a complete sentence of ``spec``."""
    matcher = compiler.compile(spec).deep_copy()
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def spec(**fields) -> GrammarSpec:
    return StructuredOutputsParams(**fields).spec


def test_each_kind_accepts_exactly_its_language(compiler):
    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    assert accepts(compiler, spec(json=person), '{"name":"Ann","age":7}')
    assert not accepts(compiler, spec(json=person), '{"name":"Ann","age":-7}')
    assert not accepts(compiler, spec(json=person), '{"name": "Ann", "age": 7}')  # compact
    assert not accepts(compiler, spec(json=person), '{"name":"Ann"}')
    assert accepts(compiler, spec(json_object=True), '{"k":[1,2]}')
    assert not accepts(compiler, spec(json_object=True), '[1]')
    assert accepts(compiler, spec(regex=r"\d{3}-[a-z]+"), "123-abc")
    assert not accepts(compiler, spec(regex=r"\d{3}"), "١٢٣")  # \d is ASCII, as in JSON
    assert accepts(compiler, spec(choice=["red", "green"]), "green")
    assert not accepts(compiler, spec(choice=["red", "green"]), "gre")
    gbnf = 'root ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" root ")"'
    assert accepts(compiler, spec(grammar=gbnf), "(1+2)*3")
    assert not accepts(compiler, spec(grammar=gbnf), "(1+2")
    lark = 'start: expr\nexpr: NUM ("+" NUM)*\nNUM: /[0-9]+/'
    assert accepts(compiler, spec(grammar=lark), "4+20")


@pytest.mark.parametrize("fields,needle", [
    ({"json": {"type": "foo"}}, "Invalid type"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Unsatisfiable"),
    ({"json": {"type": "array", "uniqueItems": True}}, "Unimplemented"),
    ({"json": {"type": "string", "format": "no-such-format"}}, "format"),
    ({"regex": "(ab"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ({"grammar": "this is not a grammar"}, ""),
])
def test_a_bad_spec_fails_with_one_short_line(compiler, fields, needle):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec(**fields))
    message = str(e.value)
    assert needle in message and "\n" not in message and len(message) <= 300, message


def test_unsupported_keywords_are_ignored_only_without_strict(compiler):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(GrammarError):
        compiler.compile(spec(json=schema))
    assert accepts(compiler, spec(json=schema, strict=False), "[1,1]")


def test_pathological_grammars_are_bounded_by_the_limits(compiler):
    """1000 optional properties build rows past max_items_in_row once the object opens
    (the first token, tried at compile); a recursion 300 deep exceeds the schema
    compiler's depth: both fail fast instead of running on."""
    deep = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(GrammarError, match="recursion"):
        compiler.compile(spec(json=deep))
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                             for i in range(1000)}}
    with pytest.raises(GrammarError, match="max is 2000"):
        compiler.compile(spec(json=wide))


@pytest.mark.parametrize("regex", ["(a{1000}){1000}", "a{1000000}", "x(a{1000}){1000}"])
def test_a_lexer_that_outgrows_its_limits_on_the_first_step_is_refused(compiler, regex):
    # its first mask computes; its first token does not (a client's probe): refused here,
    # not ended early mid-generation with output that breaks the regex
    with pytest.raises(GrammarError, match="too many expressions"):
        compiler.compile(spec(regex=regex))
    assert accepts(compiler, spec(regex="(a{10}){10}"), "a" * 100)


def test_the_choice_text_is_json_and_bounded():
    assert json.loads(spec(choice=['say "hi"', "a\\b"]).text) == ['say "hi"', "a\\b"]


def test_a_tokenizer_loader_runs_once_on_the_first_grammar(smollm_tokenizer):
    """The worker passes a loader: nothing is built until a grammar comes, then once."""
    calls = []

    def load():
        calls.append(1)
        return smollm_tokenizer

    lazy = GrammarCompiler(load, 49152, smollm_tokenizer.eos_token_ids)
    assert calls == []
    assert accepts(lazy, spec(regex=r"[ab]+"), "abba")
    assert accepts(lazy, spec(choice=["yes", "no"]), "no")
    assert calls == [1] and lazy.tokenizer is smollm_tokenizer
