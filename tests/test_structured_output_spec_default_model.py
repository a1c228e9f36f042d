"""Structured outputs with speculative decoding on the default model (float32, greedy):
8 JSON schemas, 2 regexes and 2 choices, with 4 free requests in the same batch. With
n-gram drafts and with the model as its own draft, every output is token for token the
one without speculation, the constrained ones validate, and drafts were accepted."""
import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine_core.sampling_params import SamplingParams

ENTRIES = {e["name"]: e for e in json.loads(
    (Path(__file__).parent / "data" / "structured_output_schemas.json").read_text())}
SCHEMAS = ["person", "rating", "weather", "flight", "enum_size", "timespan", "team",
           "playlist"]  # the last two: arrays of objects, whose keys repeat (n-gram hits)
REGEXES = [("A date.", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"),
           ("An IPv4 address.", r"([0-9]{1,3}\.){3}[0-9]{1,3}")]
CHOICES = [("Pick a season.", ["spring", "summer", "autumn", "winter"]),
           ("Which is a fruit?", ["apple", "carrot", "potato"])]


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt + " Reply with JSON only."}]


def requests():
    convs, params, checks = [], [], []
    for i in range(4):
        convs.append(chat(f"Tell me fact number {i} about the sea."))
        params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        checks.append(None)
    for name in SCHEMAS:
        schema = ENTRIES[name]["schema"]
        convs.append(chat(ENTRIES[name]["prompt"]))
        params.append(SamplingParams(temperature=0, max_tokens=160,
                                     structured_outputs={"json": schema}))
        checks.append(lambda t, s=schema: jsonschema.Draft202012Validator(s).is_valid(
            json.loads(t)))
    for prompt, rx in REGEXES:
        convs.append(chat(prompt))
        params.append(SamplingParams(temperature=0, max_tokens=32,
                                     structured_outputs={"regex": rx}))
        checks.append(lambda t, rx=rx: re.fullmatch(rx, t) is not None)
    for prompt, options in CHOICES:
        convs.append(chat(prompt))
        params.append(SamplingParams(temperature=0, max_tokens=8,
                                     structured_outputs={"choice": options}))
        checks.append(lambda t, o=options: t in o)
    return convs, params, checks


def make_llm(**kw):
    from folio import LLM
    return LLM(dtype="float32", max_model_len=1024, **{"observability.log_level": "warning"},
               **kw)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference():
    convs, params, _ = requests()
    return tokens(make_llm().chat(convs, params, use_tqdm=False))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_outputs_with_drafts_equal_those_without(reference, method):
    convs, params, checks = requests()
    llm = make_llm(speculative_method=method, speculative_draft_model="default")
    outs = llm.chat(convs, params, use_tqdm=False)
    assert tokens(outs) == reference
    for out, check in zip(outs, checks):
        if check is not None:
            assert out.outputs[0].finish_reason == "stop"
            assert check(out.outputs[0].text), out.outputs[0].text
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens > 0
