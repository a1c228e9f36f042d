"""Traces, metrics and logs of a real `folio serve` stack (tiny model, two API
processes, a small KV pool so that concurrent requests get preempted), exporting to a
real OTLP receiver in this process."""
import asyncio
import json
import shutil
import tempfile

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from observability.otlp_receiver import OTLPReceiver
from observability.trace_tree import format_tree
from tests.services.serve_process import ServeProcess, write_config
from tests.services.test_serve_e2e import MODEL
from services.transport import Endpoint

LONG = dict(model=MODEL, max_tokens=200, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def receiver():
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory, receiver):
    folder = tmp_path_factory.mktemp("obs")
    socket_dir = tempfile.mkdtemp(prefix="folio-")  # short: unix socket paths are limited
    config = write_config(
        folder / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
        model={"max_model_len": 256}, memory={"num_blocks": 40},
        observability={"log_level": "info", "log_format": "json",
                       "otlp_endpoint": receiver.url, "trace_step_detail": "step"},
        services={"num_api_servers": 2, "socket_dir": socket_dir})
    serve = ServeProcess(config, folder, env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    serve.wait_ready()
    serve.socket_dir = socket_dir
    yield serve
    assert serve.stop() == 0
    shutil.rmtree(socket_dir, ignore_errors=True)


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def by_id(spans):
    return {s.span_id: s for s in spans}


def test_one_chat_request_is_one_trace_across_the_three_services(stack, receiver):
    async def main():
        return await client(stack.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0, extra_body={"ignore_eos": True})
    reply = asyncio.run(main())

    def complete(spans):
        roots = [s for s in spans if s.attributes.get("gen_ai.response.id") == reply.id
                 and s.service == "folio-api"]
        if not roots:
            return False
        trace = [s for s in spans if s.trace_id == roots[0].trace_id]
        steps = [s for s in trace if s.name in ("engine.prefill", "engine.decode")]
        linked = {span_id for s in steps for _, span_id in s.links}
        executed = {s.parent_span_id for s in spans if s.name == "worker.execute"}
        decoded = sum(s.attributes["folio.num_tokens"] for s in steps
                      if s.name == "engine.decode")
        return (decoded == 5 and linked <= executed and {
            "engine.request", "worker.add_request", "api.respond", "engine.queue",
            "tokenize"} <= {s.name for s in trace})
    spans = receiver.wait_for(complete)
    root = next(s for s in spans if s.attributes.get("gen_ai.response.id") == reply.id)
    assert root.name == f"chat {MODEL}" and root.parent_span_id == ""
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert "gen_ai.server.time_to_first_token" in root.attributes
    trace = [s for s in spans if s.trace_id == root.trace_id]
    assert {s.service for s in trace} == {"folio-api", "folio-engine-core", "folio-worker"}
    tree = format_tree(trace).splitlines()
    assert tree[0].startswith(f"chat {MODEL} [folio-api]")
    assert any(line.startswith("  engine.request [folio-engine-core]") for line in tree)
    assert any(line.startswith("    worker.add_request [folio-worker]") for line in tree)
    children = {}
    for s in trace:
        children.setdefault(s.parent_span_id, []).append(s)
    assert {s.name for s in children[root.span_id]} == {"tokenize", "api.respond",
                                                         "engine.request"}
    engine_request = next(s for s in trace if s.name == "engine.request")
    below = [s.name for s in children[engine_request.span_id]]
    assert below.count("engine.queue") == 1 and below.count("worker.add_request") == 1
    assert below.count("engine.prefill") == 1  # a short prompt: one chunk
    # one span per decode step, or per run of decode steps (num_scheduler_steps)
    decodes = [s for s in children[engine_request.span_id] if s.name == "engine.decode"]
    assert 2 <= len(decodes) <= 5
    assert sum(s.attributes["folio.num_tokens"] for s in decodes) == 5
    assert "first_token" in engine_request.events
    assert engine_request.attributes["gen_ai.response.finish_reasons"] == ["length"]
    # from each step span of the request, a link reaches the worker's work for that step
    all_by_id = by_id(spans)
    for step in (s for s in trace if s.name in ("engine.prefill", "engine.decode")):
        (link_trace, link_span), = step.links
        engine_step = all_by_id[link_span]
        assert engine_step.name == "engine.step" and engine_step.trace_id == link_trace
        assert (root.trace_id, engine_request.span_id) in engine_step.links
        workers = [s for s in spans if s.parent_span_id == engine_step.span_id]
        assert [w.name for w in workers] == ["worker.execute"]
        if step.name == "engine.decode":
            assert engine_step.attributes["folio.num_decode_steps"] == \
                step.attributes["folio.num_tokens"]
        assert workers[0].attributes["folio.forward_seconds"] > 0


def test_client_traceparent_joins_its_trace(stack, receiver):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Hello", "max_tokens": 3},
                    headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}) as r:
                assert r.status == 200
    asyncio.run(main())
    spans = receiver.wait_for(lambda sp: {"folio-worker", f"text_completion {MODEL}"} <= {
        x for s in sp if s.trace_id == trace_id for x in (s.service, s.name)})
    root = next(s for s in spans if s.trace_id == trace_id and s.service == "folio-api"
                and s.name == f"text_completion {MODEL}")
    assert root.parent_span_id == parent_id


def scrape(endpoint_or_url) -> dict:
    async def get():
        if isinstance(endpoint_or_url, Endpoint):
            connector, url = endpoint_or_url.connector(), endpoint_or_url.url("/metrics")
        else:
            connector, url = None, endpoint_or_url + "/metrics"
        async with aiohttp.ClientSession(connector=connector) as s:
            async with s.get(url) as r:
                assert r.status == 200
                return await r.text()
    samples = {}
    for family in text_string_to_metric_families(asyncio.run(get())):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                  if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def delta(after, before, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_move_by_the_right_amounts(stack):
    before = scrape(stack.url)
    prompts = [[100 + i for i in range(n)] for n in (5, 17, 40)]

    async def known_workload():
        c = client(stack.url)
        await asyncio.gather(*(c.completions.create(
            model=MODEL, prompt=p, max_tokens=10, temperature=0,
            extra_body={"ignore_eos": True}) for p in prompts))
    asyncio.run(known_workload())
    after = scrape(stack.url)
    assert delta(after, before, "folio:generation_tokens_total") == 30
    assert delta(after, before, "folio:prompt_tokens_total") == 5 + 17 + 40
    assert delta(after, before, "folio:request_success_total", finished_reason="length") == 3
    assert delta(after, before, "folio:time_to_first_token_seconds_count") == 3
    assert delta(after, before, "folio:e2e_request_latency_seconds_count") == 3
    assert delta(after, before, "folio:request_generation_tokens_sum") == 30
    assert delta(after, before, "folio:inter_token_latency_seconds_count") == 27

    repeated = [200 + i for i in range(70)]  # 4 full blocks of 16 tokens

    async def twice():
        c = client(stack.url)
        for _ in range(2):
            await c.completions.create(model=MODEL, prompt=repeated, max_tokens=2)
    before = scrape(stack.url)
    asyncio.run(twice())
    after = scrape(stack.url)
    assert delta(after, before, "folio:prefix_cache_queries_total") == 140
    assert delta(after, before, "folio:prefix_cache_hits_total") == 64

    # both API processes serve the same engine-wide numbers
    api0 = scrape(Endpoint(unix_path=f"{stack.socket_dir}/api-0.sock"))
    api1 = scrape(Endpoint(unix_path=f"{stack.socket_dir}/api-1.sock"))
    key = ("folio:generation_tokens_total", ())
    assert api0[key] == api1[key] == after[key]


def test_preemption_shows_in_traces_metrics_and_logs(stack, receiver):
    before = scrape(stack.url)

    # Each request grows to 16 blocks (46 prompt tokens + 200), so any three running at
    # once overflow the 39 usable blocks; eight of them still overlap when a loaded
    # machine spreads their arrivals out (with four of 12 blocks, which needed all four
    # at once, one CI run saw no preemption).
    prompt = "Once upon a time there was a story about " + "a very long road and " * 7

    async def crowd():
        c = client(stack.url)
        return await asyncio.gather(*(c.completions.create(prompt=f"{prompt}{i}", **LONG)
                                      for i in range(8)))
    replies = asyncio.run(crowd())
    after = scrape(stack.url)
    num_preemptions = delta(after, before, "folio:num_preemptions_total")
    assert num_preemptions > 0
    ids = {r.id for r in replies}
    spans = receiver.wait_for(lambda sp: any(
        "preempted" in s.events for s in sp if s.name == "engine.request"))
    preempted = [s for s in spans if s.name == "engine.request" and "preempted" in s.events]
    assert all("resumed" in s.events for s in preempted)
    log_lines = [json.loads(line) for line in stack.err_path.read_text().splitlines()
                 if line.startswith("{")]
    preemption_lines = [line for line in log_lines if line["event"] == "request preempted"
                        and line["request_id"] in ids]
    assert len(preemption_lines) == num_preemptions
    assert all("kv_cache_full" in line["reason"] for line in preemption_lines)


def test_log_lines_of_a_request_share_its_request_and_trace_ids(stack):
    async def main():
        return await client(stack.url).completions.create(model=MODEL, prompt="Log me",
                                                          max_tokens=4)
    reply = asyncio.run(main())
    lines = [json.loads(line) for line in stack.err_path.read_text().splitlines()
             if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id") == reply.id]
    assert {line["service"] for line in mine} == {"api", "engine-core"}
    assert {line["event"] for line in mine} >= {"request received", "request added",
                                                "request finished"}
    trace_ids = {line["trace_id"] for line in mine}
    assert len(trace_ids) == 1 and len(trace_ids.pop()) == 32
