"""Issue 17 at the API edge (a real API process on a fake engine): every structured-output
field and tools/tool_choice reach the engine as one StructuredOutputsParams; bad ones are
a 400 naming the field with nothing sent; outputs come back in OpenAI's tool-call shape,
streaming or not; the grammar compile is a span under the request."""
import asyncio
import json

import aiohttp
import openai

from config.schema import APIConfig
from engine_core.outputs import EngineCoreOutput, FinishReason
from engine_core.structured_outputs import GrammarSpec
from tests.services.api_harness import api_server
from tests.services.test_api_validation import CHAT, CMPL, assert_openai_error, chat, cmpl

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}

BAD = [  # (id, path, body, param)
    ("schema-invalid-type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}), "response_format"),
    ("schema-unsatisfiable", CMPL, cmpl(guided_json={"type": "integer", "minimum": 3,
                                                     "maximum": 1}), "guided_json"),
    ("schema-strict-unsupported-keyword", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "array", "uniqueItems": True}}}), "response_format"),
    ("schema-not-an-object", CHAT, chat(guided_json=[1, 2]), "guided_json"),
    ("schema-missing", CHAT, chat(response_format={"type": "json_schema"}), "response_format"),
    ("regex-uncompilable", CMPL, cmpl(structured_outputs={"regex": "(ab"}),
     "structured_outputs"),
    ("regex-empty", CMPL, cmpl(guided_regex=""), "guided_regex"),
    ("grammar-undefined-rule", CMPL, cmpl(guided_grammar="root ::= nowhere"),
     "guided_grammar"),
    ("grammar-garbage", CHAT, chat(structured_outputs={"grammar": "}{ not a grammar"}),
     "structured_outputs"),
    ("choice-empty", CMPL, cmpl(guided_choice=[]), "guided_choice"),
    ("choice-not-strings", CMPL, cmpl(structured_outputs={"choice": [1, 2]}),
     "structured_outputs"),
    ("two-constraints", CHAT, chat(guided_regex="a+", response_format={
        "type": "json_object"}), "guided_regex"),
    ("structured-outputs-two-kinds", CMPL, cmpl(structured_outputs={
        "regex": "a", "choice": ["a"]}), "structured_outputs"),
    ("structured-outputs-unknown-key", CMPL, cmpl(structured_outputs={
        "structural_tag": "x"}), "structured_outputs"),
    ("response-format-unknown-type", CHAT, chat(response_format={"type": "yaml"}),
     "response_format"),
    ("grammar-too-long", CMPL, cmpl(guided_regex="a" * 70_000), "guided_regex"),
    ("min-tokens-with-grammar", CMPL, cmpl(guided_choice=["a"], min_tokens=2), "min_tokens"),
    ("tools-not-functions", CHAT, chat(tools=[{"type": "retrieval"}],
                                       tool_choice="required"), "tools"),
    ("tools-bad-name", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "no spaces"}}], tool_choice="required"), "tools"),
    ("tools-duplicate", CHAT, chat(tools=[WEATHER, WEATHER], tool_choice="required"),
     "tools"),
    ("tools-bad-parameters", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}}}], tool_choice="required"), "tools"),
    ("tool-choice-unknown-function", CHAT, chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "launch"}}), "tool_choice"),
    ("tool-choice-auto-refused", CHAT, chat(tools=[WEATHER], tool_choice="auto"),
     "tool_choice"),
    ("tool-choice-default-is-auto", CHAT, chat(tools=[WEATHER]), "tool_choice"),
    ("tool-choice-bad-shape", CHAT, chat(tools=[WEATHER], tool_choice=5), "tool_choice"),
    ("parallel-tool-calls-not-bool", CHAT, chat(tools=[WEATHER], tool_choice="required",
                                                parallel_tool_calls="no"),
     "parallel_tool_calls"),
    ("tools-with-response-format", CHAT, chat(tools=[WEATHER], tool_choice="required",
                                              response_format={"type": "json_object"}),
     "tools"),
    ("tools-on-completions", CMPL, cmpl(tools=[WEATHER]), "tools"),
]


def run(coro):
    return asyncio.run(coro)


async def post(url: str, path: str, raw: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=raw.encode()) as r:
            return r.status, await r.read()


def test_each_bad_constraint_is_a_400_naming_its_field_and_nothing_reaches_the_engine(
        smollm_tokenizer):
    """One server for every case (the first builds its llguidance tokenizer); it keeps
    serving a valid constrained request afterwards."""
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            for case, path, raw, param in BAD:
                status, body = await post(url, path, raw)
                try:
                    assert_openai_error(status, body, 400, param)
                except AssertionError as e:
                    raise AssertionError(f"{case}: {e}") from None
                assert engine.added == [], case
            status, _ = await post(url, CHAT, chat(tools=[WEATHER], tool_choice=NAMED))
            assert status == 200 and len(engine.added) == 1
    run(main())


def test_a_grammar_too_slow_to_compile_is_refused_and_the_verdict_kept(smollm_tokenizer):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                             for i in range(1000)}}
    api = APIConfig(grammar_compile_timeout_s=0.05)

    async def main():
        async with api_server(smollm_tokenizer, api) as (url, engine):
            for _ in range(2):  # the second answer comes from the kept verdict
                status, body = await post(url, CMPL, cmpl(guided_json=wide))
                assert_openai_error(status, body, 400, "guided_json")
                assert "within 0.05 s" in json.loads(body)["error"]["message"]
            status, _ = await post(url, CMPL, cmpl(guided_choice=["still", "serving"]))
            assert status == 200 and len(engine.added) == 1
    run(main())


def test_each_field_reaches_the_engine_as_one_grammar(smollm_tokenizer):
    accepted = [
        (CHAT, chat(response_format={"type": "json_object"}), GrammarSpec(
            "json", '{"type": "object"}')),
        (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": SCHEMA}}), GrammarSpec("json", json.dumps(SCHEMA), False)),
        (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
            "name": "s", "schema": SCHEMA, "strict": True}}), GrammarSpec(
            "json", json.dumps(SCHEMA))),
        (CMPL, cmpl(structured_outputs={"regex": r"\d+"}), GrammarSpec("regex", r"\d+")),
        (CMPL, cmpl(structured_outputs={"json_object": True}), GrammarSpec(
            "json", '{"type": "object"}')),
        (CMPL, cmpl(guided_choice=["a", "b"]), GrammarSpec("choice", '["a", "b"]')),
        (CMPL, cmpl(guided_grammar='root ::= "x"'), GrammarSpec("grammar", 'root ::= "x"')),
        (CMPL, cmpl(guided_json=json.dumps(SCHEMA)), GrammarSpec("json", json.dumps(SCHEMA))),
        (CHAT, chat(tools=[WEATHER, TIME], tool_choice=NAMED), GrammarSpec(
            "json", json.dumps(WEATHER["function"]["parameters"]), False)),
        (CHAT, chat(tools=[WEATHER], tool_choice="none"), None),
        (CHAT, chat(response_format={"type": "text"}), None),
    ]

    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            for path, raw, spec in accepted:
                status, body = await post(url, path, raw)
                assert status == 200, body
                so = engine.added[-1][2].structured_outputs
                assert (so.spec if so is not None else None) == spec, raw
            status, body = await post(url, CHAT, chat(tools=[WEATHER, TIME],
                                                      tool_choice="required",
                                                      parallel_tool_calls=False))
            schema = json.loads(engine.added[-1][2].structured_outputs.json)
            assert schema["minItems"] == schema["maxItems"] == 1
            names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
            assert names == ["get_weather", "get_time"]
    run(main())


def scripted(tokenizer, texts: list[str], finish=FinishReason.STOP):
    """A FakeEngine script answering each sample with ``texts`` in two deltas."""
    def script(req_id, params):
        outs = []
        for i, text in enumerate(texts[:params.n]):
            ids = tokenizer.encode(text, add_special_tokens=False)
            child = req_id if params.n == 1 else f"{i}_{req_id}"
            parent = None if params.n == 1 else req_id
            half = len(ids) // 2
            outs += [EngineCoreOutput(child, ids[:half], parent_req_id=parent, index=i),
                     EngineCoreOutput(child, ids[half:], finish_reason=finish,
                                      parent_req_id=parent, index=i)]
        return outs
    return script


def test_tool_calls_come_back_in_openai_shape_streaming_or_not(smollm_tokenizer):
    required = '[{"name":"get_weather","arguments":{"city":"Paris"}},' \
               '{"name":"get_time","arguments":{"zone":"CET"}}]'

    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            ask = dict(model="folio-tiny", messages=[{"role": "user", "content": "Hi"}],
                       tools=[WEATHER, TIME])
            engine.script = scripted(smollm_tokenizer, ['{"city":"Oslo"}', '{"city":"Rome"}'])
            reply = await client.chat.completions.create(tool_choice=NAMED, n=2, **ask)
            for choice, city in zip(reply.choices, ("Oslo", "Rome")):
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
                (call,) = choice.message.tool_calls
                assert call.id.startswith("call_") and call.type == "function"
                assert call.function.name == "get_weather"
                assert json.loads(call.function.arguments) == {"city": city}
            engine.script = scripted(smollm_tokenizer, [required])
            reply = await client.chat.completions.create(tool_choice="required", **ask)
            calls = reply.choices[0].message.tool_calls
            assert [c.function.name for c in calls] == ["get_weather", "get_time"]
            assert len({c.id for c in calls}) == 2
            assert json.loads(calls[1].function.arguments) == {"zone": "CET"}
            for tool_choice, text in ((NAMED, '{"city":"Oslo"}'), ("required", required)):
                engine.script = scripted(smollm_tokenizer, [text])
                calls, finish = await streamed_tool_calls(client, tool_choice=tool_choice,
                                                          **ask)
                assert finish == "tool_calls" and calls, (tool_choice, calls)
                assert all(c["id"].startswith("call_") for c in calls.values())
                expected = json.loads(text)
                expected = expected if isinstance(expected, list) else [
                    {"name": "get_weather", "arguments": expected}]
                assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
                    [(e["name"], e["arguments"]) for e in expected]
            engine.script = scripted(smollm_tokenizer, ['{"city":"Os'], FinishReason.LENGTH)
            reply = await client.chat.completions.create(tool_choice=NAMED, **ask)
            assert reply.choices[0].finish_reason == "length"  # cut: no call to return
            assert reply.choices[0].message.content == '{"city":"Os'
    run(main())


async def streamed_tool_calls(client, **kw) -> tuple[dict, str | None]:
    """Accumulate a stream's delta.tool_calls as a client does: {index: call}."""
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return calls, finish


def test_the_compile_is_a_span_under_the_request_and_repeats_hit_the_cache(
        smollm_tokenizer):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        async with api_server(smollm_tokenizer, tracer=provider.get_tracer("t")) as (url, _):
            for _ in range(2):
                status, _ = await post(url, CMPL, cmpl(guided_regex="[a-z]{3}"))
                assert status == 200
    run(main())
    spans = exporter.get_finished_spans()
    compiles = [s for s in spans if s.name == "structured_output.compile"]
    roots = {s.context.span_id: s for s in spans if s.parent is None}
    assert len(compiles) == 2
    assert all(c.parent.span_id in roots for c in compiles)
    assert [c.attributes["folio.cache_hit"] for c in compiles] == [False, True]
    assert compiles[0].attributes["folio.grammar_kind"] == "regex"
