"""Speculative decoding through `folio serve`: drafts cross the process boundary (the
draft model runs in the worker process), greedy completions over HTTP equal the
offline engine's without speculation, /metrics carries the spec-decode counters and
`folio bench serve` reports the acceptance rate from them; structured outputs are
served (200) with drafts checked against their grammars."""
import asyncio
import json
import re

import jsonschema

import aiohttp
import openai
import pytest

from engine_core.sampling_params import SamplingParams
from folio.bench.spec_metrics import parse_spec_counters
from tests.services.serve_process import ServeProcess, write_config
from tests.services.test_serve_e2e import MODEL

PROMPTS = [[100 + i for i in range(n)] for n in (5, 23, 60)]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tiny_llama_draft_dir, default_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve_spec")
    config = write_config(folder / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
                          speculative={"method": "draft_model", "num_speculative_tokens": 3,
                                       "draft_model": str(tiny_llama_draft_dir)})
    serve = ServeProcess(config, folder)
    serve.wait_ready()
    yield serve
    assert serve.stop() == 0, serve.output()[-3000:]


async def metrics(url):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            return parse_spec_counters(await r.text())


def test_greedy_over_http_equals_offline_and_counters_move(stack, make_tiny_llm):
    offline = make_tiny_llm().generate([{"prompt_token_ids": p} for p in PROMPTS],
                                       SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True), use_tqdm=False)

    async def main():
        before = await metrics(stack.url)
        c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        replies = await asyncio.gather(*(c.completions.create(
            model=MODEL, prompt=p, max_tokens=20, temperature=0,
            extra_body={"ignore_eos": True}) for p in PROMPTS))
        return before, replies, await metrics(stack.url)
    before, replies, after = asyncio.run(main())
    assert [r.choices[0].text for r in replies] == [o.outputs[0].text for o in offline]
    proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert proposed > 0 and accepted == proposed  # the model drafting for itself
    assert len(after["num_accepted_tokens_per_pos"]) == 3


def test_bench_serve_reports_the_acceptance_rate(stack, smollm_tokenizer):
    from folio.bench.serve import LoadSpec, bench_serve, format_report
    from folio.bench.workload import make_workload
    reqs = make_workload(smollm_tokenizer, "fixed", 4, input_len=16, output_len=12)
    report = bench_serve(stack.url, MODEL, reqs, LoadSpec(max_concurrency=2))
    spec = report["spec_decode"]
    assert report["completed"] == 4 and spec["num_draft_tokens"] > 0
    assert spec["acceptance_rate"] == 1.0 and spec["mean_acceptance_length"] > 1
    assert "spec decode: acceptance rate 100.0%" in format_report(report)


def test_structured_requests_are_served_with_speculation(stack, make_tiny_llm):
    """A regex, a choice and a JSON schema over HTTP against the spec-decoding stack:
    200, valid, and (greedy) the offline engine's tokens without speculation; a named
    tool call's arguments validate."""
    from tests.services.test_serve_structured import CITY, TOOLS, assert_valid_calls
    cases = [({"guided_regex": r"[a-z]{2,5}-\d{2}"}, {"regex": r"[a-z]{2,5}-\d{2}"}),
             ({"guided_choice": ["left", "right"]}, {"choice": ["left", "right"]}),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "city", "schema": CITY}}}, {"json": CITY})]
    offline = make_tiny_llm().generate(
        [{"prompt_token_ids": PROMPTS[1]}] * len(cases),
        [SamplingParams(temperature=0, max_tokens=40, structured_outputs=fields)
         for _, fields in cases], use_tqdm=False)

    async def main():
        c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        replies = await asyncio.gather(*(c.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, extra_body=extra)
            for extra, _ in cases))
        call = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=TOOLS, max_tokens=64, temperature=0.8, seed=4, tool_choice={
                "type": "function", "function": {"name": "get_weather"}})
        return replies, call
    replies, call = asyncio.run(main())
    texts = [r.choices[0].text for r in replies]
    assert texts == [o.outputs[0].text for o in offline]
    assert all(r.choices[0].finish_reason == "stop" for r in replies)
    assert re.fullmatch(r"[a-z]{2,5}-\d{2}", texts[0]) and texts[1] in ("left", "right")
    jsonschema.validate(json.loads(texts[2]), CITY)
    assert call.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(call.choices[0].message.tool_calls, {"get_weather"})
