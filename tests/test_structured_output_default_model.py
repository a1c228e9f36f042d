"""Issue 17 on the default model (SmolLM2-135M-Instruct, float32), offline.

Validity: the 50 JSON schemas of tests/data/structured_output_schemas.json (nested
objects, arrays with min/max items, enums, anyOf, bounded numbers and integers, strings
with patterns and formats, required and optional fields, additionalProperties false) at
temperature 0.8, 3 seeds each, plus regexes, choices and an arithmetic grammar, all in
one batched run: 100% parse and validate. (How often the model alone, without
constraints, writes valid output: benchmarks/structured_output.py --validity.)

Mixing: 32 greedy requests, 16 constrained by 8 schemas and 16 free, in one batch:
the constrained ones validate and the free ones are token-identical to a run without
any constrained request.
"""
import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine_core.sampling_params import SamplingParams

ENTRIES = json.loads((Path(__file__).parent / "data" /
                      "structured_output_schemas.json").read_text())
CHECKER = jsonschema.FormatChecker()
REGEXES = [("A US zip code.", r"[0-9]{5}"),
           ("A date.", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"),
           ("An IPv4 address.", r"([0-9]{1,3}\.){3}[0-9]{1,3}")]
CHOICES = [("Is the sky blue?", ["yes", "no"]),
           ("Pick a season.", ["spring", "summer", "autumn", "winter"]),
           ("Which is a fruit?", ["apple", "carrot", "potato"])]
ARITHMETIC = 'root ::= term (("+" | "-" | "*") term){0,4}\nterm ::= [0-9]{1,3} | "(" root ")"'


@pytest.fixture(scope="module")
def llm():
    from folio import LLM
    return LLM(dtype="float32", max_num_seqs=256, **{"observability.log_level": "warning"})


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt + " Reply with JSON only."}]


def valid(text: str, schema: dict) -> bool:
    try:
        return jsonschema.Draft202012Validator(schema, format_checker=CHECKER).is_valid(
            json.loads(text))
    except ValueError:
        return False


def arithmetic(text: str) -> bool:
    term = r"([0-9]{1,3}|\(.*\))"
    if not re.fullmatch(rf"{term}([-+*]{term}){{0,4}}", text):
        return False
    try:
        compile(text, "<arithmetic>", "eval")  # balanced, well-formed
    except SyntaxError:
        return False
    return True


def test_fifty_schemas_three_seeds_regex_choice_and_grammar_all_valid(llm):
    """One batched run: 53 requests of n=3 seeded samples (seeds s, s+1, s+2; the prompt
    is computed once and forked) and 6 of one, temperature 0.8, at most 256 tokens."""
    convs, params, checks = [], [], []

    def add(prompt, fields, check, n=3):
        convs.append(chat(prompt))
        params.append(SamplingParams(temperature=0.8, seed=0, n=n, max_tokens=256,
                                     structured_outputs=fields))
        checks.append(check)

    for entry in ENTRIES:
        add(entry["prompt"], {"json": entry["schema"]},
            lambda t, s=entry["schema"]: valid(t, s))
    for prompt, rx in REGEXES:
        add(prompt, {"regex": rx}, lambda t, rx=rx: re.fullmatch(rx, t) is not None, 1)
    for prompt, options in CHOICES:
        add(prompt, {"choice": options}, lambda t, o=options: t in o, 1)
    add("Write a sum of small numbers.", {"grammar": ARITHMETIC}, arithmetic, n=3)
    outs = llm.chat(convs, params, use_tqdm=False)
    samples = [(i, s, check) for i, (o, check) in enumerate(zip(outs, checks))
               for s in o.outputs]
    assert len(samples) == 3 * len(ENTRIES) + len(REGEXES) + len(CHOICES) + 3
    failures = [(i, s.finish_reason, s.text[:120]) for i, s, check in samples
                if not check(s.text)]
    assert failures == []
    assert all(s.finish_reason == "stop" for _, s, _ in samples)


MIX = ["person", "rating", "weather", "flight", "enum_size", "timespan", "anyof_shape",
       "planet"]  # short outputs: the run lasts as long as its longest


def test_constrained_and_free_requests_mix_in_one_batch(llm):
    """Greedy, float32: free outputs beside 16 constrained ones equal a free-only run."""
    by_name = {e["name"]: e for e in ENTRIES}
    free_prompts = [chat(f"Tell me fact number {i} about the sea.") for i in range(16)]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.chat(free_prompts, free, use_tqdm=False)
    constrained = [(chat(by_name[MIX[i % 8]]["prompt"] + f" Variant {i}."),
                    by_name[MIX[i % 8]]["schema"]) for i in range(16)]
    convs, params = [], []
    for i in range(16):  # interleaved: free and constrained rows alternate in the batch
        convs += [free_prompts[i], constrained[i][0]]
        params += [free, SamplingParams(temperature=0, max_tokens=256,
                                        structured_outputs={"json": constrained[i][1]})]
    mixed = llm.chat(convs, params, use_tqdm=False)
    for a, b in zip(alone, mixed[0::2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for (_, schema), out in zip(constrained, mixed[1::2]):
        assert valid(out.outputs[0].text, schema), out.outputs[0].text
