"""Issue 17 end to end, offline, on the tiny random Llama: whatever it emits comes from
the mask alone, so every output that matches its grammar is the mask's doing. Regex
outputs fully match, choices are members, an arithmetic grammar's outputs parse, JSON
validates; n > 1 gives each sample its own matcher; forced preemption and prefix-cache
hits change no token; free requests beside constrained ones are token-identical to a
run without them."""
import json
import re

import jsonschema
import pytest

from engine_core.sampling_params import InvalidRequestError, SamplingParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
             "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def _valid(text: str, kind: str, value) -> bool:
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    if kind == "arithmetic":
        return re.fullmatch(r"[0-9]{1,3}([+*][0-9]{1,3}){0,3}", text) is not None
    try:
        jsonschema.validate(json.loads(text), value)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CASES = [
    ("regex", r"[0-9]{3}-[a-z]{2,4}", {"regex": r"\d{3}-[a-z]{2,4}"}),
    ("choice", ["alpha", "beta", "gamma delta"], {"choice": ["alpha", "beta", "gamma delta"]}),
    ("arithmetic", None, {"grammar": 'root ::= term (("+" | "*") term){0,3}\n'
                                     'term ::= [0-9]{1,3}'}),
    ("json", PERSON, {"json": PERSON}),
]


def test_random_model_outputs_match_their_grammar_n_gt_1_and_free_rows_unchanged(
        make_tiny_llm):
    """A random model follows any grammar only through its mask; n=3 samples each get
    their own matcher; the free requests' greedy tokens equal a run without grammars."""
    llm = make_tiny_llm()
    free = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2
    alone = llm.generate(["free one", "free two"], free, use_tqdm=False)
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=i, n=3,
                             structured_outputs=fields)
              for i, (_, _, fields) in enumerate(CASES)]
    outs = llm.generate(["free one", "free two"] + ["Answer:"] * len(CASES), free + params,
                        use_tqdm=False)
    for a, b in zip(alone, outs[:2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for (kind, value, _), out in zip(CASES, outs[2:]):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (kind, sample.text)
            assert _valid(sample.text, kind, value), (kind, sample.text)
    assert len({s.text for s in outs[5].outputs}) > 1  # three matchers, three outputs


def test_preemption_and_prefix_caching_keep_outputs_and_validity(make_tiny_llm):
    """Forced preemption (a KV pool too small for the batch) rebuilds each matcher by
    replaying its tokens; a prefix-cache hit changes nothing: greedy outputs equal a
    roomy run's."""
    prompts = [f"Person number {i}, described in JSON with a name, an age and a short "
               f"list of tags, please:" for i in range(6)]  # > 16 tokens: one full block
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": PERSON})
    llm = make_tiny_llm()
    roomy = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == roomy[0].outputs[0].token_ids
    tight = make_tiny_llm(num_blocks=12, max_num_seqs=6, max_model_len=128)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    for a, b in zip(roomy, squeezed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert _valid(b.outputs[0].text, "json", PERSON), b.outputs[0].text


def test_a_bad_grammar_offline_raises_naming_the_field_and_queues_nothing(make_tiny_llm):
    llm = make_tiny_llm()
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(
            structured_outputs={"json": {"type": "nope"}})], use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


def test_a_complete_grammar_ends_the_output_even_under_ignore_eos(make_tiny_llm):
    """Once the grammar allows nothing but EOS, that EOS ends the sample ("stop") even
    with ignore_eos, rather than filling it with hidden EOS tokens up to max_tokens; a
    free request with ignore_eos still runs to max_tokens."""
    llm = make_tiny_llm()
    eos = set(llm.engine.eos_token_ids)
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, n=3, ignore_eos=True,
                             structured_outputs=fields)
              for i, (_, _, fields) in enumerate(CASES[:2])]
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = llm.generate(["Answer:"] * 2 + ["free"], params + [free], use_tqdm=False)
    for (kind, value, _), out in zip(CASES, outs[:2]):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (kind, sample.text, sample.token_ids)
            assert sample.token_ids[-1] in eos and len(sample.token_ids) < 40
            assert _valid(sample.text, kind, value), (kind, sample.text)
    assert len(outs[2].outputs[0].token_ids) == 40
