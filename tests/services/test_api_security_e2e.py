"""Issue 6, items 9, 10 and 12 on a real `folio serve` stack (tiny model, two API
processes), with one key from the YAML and one from FOLIO_API_KEYS:

- tenant isolation of the prefix cache: tenant B's repeat of tenant A's long prompt
  gets zero cached tokens while A's own repeat (through either API process) hits;
- keys are enforced by the real processes;
- schemathesis fuzzes every operation of GET /openapi.json (valid and invalid data):
  no 5xx, responses match the document, invalid data is refused, the stack survives.
"""
import asyncio
import os

import aiohttp
import openai
import pytest
import requests

from tests.services.serve_process import ServeProcess, write_config
from tests.services.test_serve_e2e import wait_engine_clean

MODEL = "folio-tiny"
KEY_A, KEY_B = "sk-yaml-tenant-a-5f1c", "sk-env-tenant-b-9e7d"
# 67 tokens: four full 16-token blocks can be shared
PROMPT = ("You are a careful assistant for a small bakery. Answer questions about bread, "
          "opening hours and allergies. Be brief and polite, never invent prices, and ask "
          "for clarification when the question is unclear. Today's specials: rye sourdough, "
          "spelt rolls, a walnut loaf and cinnamon buns. Question: what is gluten free?")
FUZZ_EXAMPLES = int(os.environ.get("FOLIO_FUZZ_EXAMPLES", "10"))  # per operation and mode


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("secure")
    config = write_config(folder / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
                          model={"max_model_len": 96}, memory={"num_blocks": 64},
                          scheduler={"max_num_seqs": 8},
                          services={"num_api_servers": 2},
                          api={"api_keys": [KEY_A], "max_n": 2})
    serve = ServeProcess(config, folder, env={"FOLIO_API_KEYS": KEY_B})
    serve.wait_ready()
    yield serve
    assert serve.stop() == 0, serve.output()[-3000:]
    output = serve.output()
    assert KEY_A not in output and KEY_B not in output  # nor in any service's logs


def client(url, key):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def cached_tokens(key, url, stream: bool = False) -> int:
    """Prompt tokens served from the cache, on a new connection (so that repeats are
    spread over the two API processes)."""
    c = client(url, key)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    if not stream:
        out = await c.completions.create(**kwargs)
        return out.usage.prompt_tokens_details.cached_tokens
    chunks = await c.completions.create(**kwargs, stream=True,
                                        stream_options={"include_usage": True})
    usage = [ch.usage async for ch in chunks if ch.usage is not None]
    return usage[-1].prompt_tokens_details.cached_tokens


def test_tenants_never_share_prefix_cache_blocks(stack):
    async def main():
        url = stack.url
        first = await client(url, KEY_A).completions.create(model=MODEL, prompt=PROMPT,
                                                             max_tokens=1, temperature=0)
        num_prompt = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert num_prompt >= 64  # four full 16-token blocks at least
        full_blocks = (num_prompt // 16) * 16
        # A's repeats hit, whichever of the two API processes serves them
        hits_a = [await cached_tokens(KEY_A, url, stream=i % 2 == 1) for i in range(4)]
        assert all(h >= full_blocks - 16 and h > 0 for h in hits_a), hits_a
        assert await cached_tokens(KEY_B, url) == 0  # B's first sight of the prompt: no A blocks
        assert await cached_tokens(KEY_B, url) > 0  # B's own repeat hits B's own blocks
        assert await cached_tokens(KEY_A, url) > 0
        await wait_engine_clean(stack.url, within=5.0, key=KEY_A)
    asyncio.run(main())


def test_real_processes_enforce_keys(stack):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(stack.url + "/health") as r:
                assert r.status == 200
                assert await r.json() == {"status": "ok"}  # the gauges need a key
            async with s.get(stack.url + "/health", headers={
                    "Authorization": f"Bearer {KEY_B}"}) as r:
                assert (await r.json())["engine"]["num_clients"] == 2
            for headers in ({}, {"Authorization": "Bearer sk-nope"}):
                for path in ("/v1/models", "/metrics", "/openapi.json", "//v1/models",
                             "/v1/%6Dodels"):
                    async with s.get(stack.url + path, headers=headers) as r:
                        assert r.status == 401, (path, headers)
        with pytest.raises(openai.AuthenticationError):
            await client(stack.url, "sk-nope").models.list()
        for key in (KEY_A, KEY_B):
            assert [m.id for m in (await client(stack.url, key).models.list()).data] == [MODEL]
    asyncio.run(main())


def test_schemathesis_fuzzing_finds_no_server_error(stack):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (content_type_conformance,
                                                   negative_data_rejection,
                                                   response_schema_conformance,
                                                   status_code_conformance)

    auth = {"Authorization": f"Bearer {KEY_A}"}
    doc = requests.get(stack.url + "/openapi.json", headers=auth, timeout=10).json()
    assert doc["security"] == [{"bearer": []}]  # the document says keys are needed...
    # ...but here every case carries the key, so negative cases negate the body rather
    # than the header (keys have their own tests above and in test_api_auth.py)
    del doc["security"]
    schema = schemathesis.openapi.from_dict(doc)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance, negative_data_rejection]
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.label for op in operations} == {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
        "POST /detokenize", "GET /v1/models", "GET /version", "GET /metrics", "GET /health",
        "GET /openapi.json"}
    num_calls = 0
    for operation in operations:
        has_body = operation.method.upper() == "POST"  # GETs take no input to negate
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:1 + has_body]:
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                      derandomize=True, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                nonlocal num_calls
                num_calls += 1
                response = case.call(base_url=stack.url, headers=auth, timeout=60)
                case.validate_response(response, checks=checks, headers=auth)

            fuzz()
    assert num_calls >= FUZZ_EXAMPLES * 4  # bodies; a GET without input is one case
    asyncio.run(wait_engine_clean(stack.url, within=10.0, key=KEY_A))  # nothing left
    assert stack.proc.poll() is None  # and the stack is still up
