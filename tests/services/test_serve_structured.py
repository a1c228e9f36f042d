"""Issue 17 through a real `folio serve` stack (tiny random model) and the official openai
client: function calling (named and required, streaming and not) returns calls whose
arguments validate; JSON schema, regex and choice outputs hold over HTTP; each bad input
is a 4xx and the server keeps serving; /metrics counts compiles and cache hits."""
import asyncio
import json
import re

import aiohttp
import jsonschema
import openai
import pytest

from tests.services.serve_process import ServeProcess, write_config
from tests.services.test_structured_api import streamed_tool_calls

MODEL = "folio-tiny"
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-structured")
    config = write_config(folder / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
                          scheduler={"max_num_seqs": 8})
    serve = ServeProcess(config, folder)
    serve.wait_ready()
    yield serve
    assert serve.stop() == 0, serve.output()[-3000:]


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def assert_valid_calls(calls, names=None):
    assert calls
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments),
                            PARAMETERS[call.function.name])


def test_function_calling_named_and_required_streaming_and_not(stack):
    async def main():
        c = client(stack.url)
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=1.0)
        named = {"type": "function", "function": {"name": "get_weather"}}
        reply = await c.chat.completions.create(tool_choice=named, n=2, seed=1, **kw)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert len(choice.message.tool_calls) == 1
            assert_valid_calls(choice.message.tool_calls, {"get_weather"})
        reply = await c.chat.completions.create(tool_choice="required", seed=2,
                                                parallel_tool_calls=False, **kw)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(reply.choices[0].message.tool_calls)
        for choice, extra in ((named, {}), ("required", {"parallel_tool_calls": False})):
            calls, finish = await streamed_tool_calls(c, tool_choice=choice, seed=3,
                                                      **extra, **kw)
            assert finish == "tool_calls" and len(calls) == 1
            (call,) = calls.values()
            assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
            jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
        # the call and its result go back through the chat template
        first = reply.choices[0].message.tool_calls[0]
        follow = await c.chat.completions.create(model=MODEL, max_tokens=4, messages=ASK + [
            {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
            {"role": "tool", "tool_call_id": first.id, "content": '{"temp": 21}'}])
        assert follow.choices[0].message.content is not None
    asyncio.run(main())


BAD = [  # (extra body, param)
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 9, "maximum": 1}}}},
     "response_format"),
    ({"guided_regex": "([a-z]"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "if": {}}}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
]


def test_constrained_outputs_over_http_bad_inputs_and_metrics(stack):
    async def main():
        c = client(stack.url)
        kw = dict(model=MODEL, messages=ASK, max_tokens=64, temperature=1.0, seed=4)
        for extra, param in BAD:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(extra_body=extra, **kw)
            assert e.value.status_code == 400 and e.value.body["param"] == param, extra
        reply = await c.chat.completions.create(response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": CITY,
                                                   "strict": True}}, **kw)
        jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)
        text = (await c.completions.create(model=MODEL, prompt="Code:", max_tokens=16,
                                           extra_body={"guided_regex": r"[A-Z]{2}-\d{3}"})
                ).choices[0].text
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text), text
        for _ in range(2):  # the second one hits the worker's grammar cache
            reply = await c.chat.completions.create(
                extra_body={"structured_outputs": {"choice": ["north", "south"]}}, **kw)
            assert reply.choices[0].message.content in ("north", "south")
        async with aiohttp.ClientSession() as s:
            async with s.get(stack.url + "/metrics") as r:
                metrics = await r.text()
        compiles = _value(metrics, "folio:structured_output_compile_seconds_count")
        assert compiles >= 3  # JSON, regex, choice: one compile each in the worker
        assert _value(metrics, "folio:structured_output_cache_hits_total") >= 1
    asyncio.run(main())


def _value(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", metrics, re.MULTILINE)
    assert match, name
    return float(match.group(1))
