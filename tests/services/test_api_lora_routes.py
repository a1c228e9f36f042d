"""The live LoRA routes at the HTTP edge, on the real API process over a fake engine core:
they exist only with lora.enable_lora and allow_runtime_updates; a malformed body is a
400 in OpenAI's shape naming its field and never reaches the engine; the engine's
refusals come back as 400 (bad adapter) and 404 (unknown name). The real stack with real
adapters is tests/services/test_lora_serve_e2e.py."""
import asyncio
import json

import aiohttp
import pytest

from config.lora import LoRAConfig
from services.protocol import LoRAAdapterInfo, LoRAReply
from tests.services.api_harness import FakeEngine, api_server

MODEL = "folio-tiny"


class LoRAEngine(FakeEngine):
    """A FakeEngine that also answers LoRA requests: ``lora_calls`` records them,
    ``replies`` maps a kind to the LoRAReply fields it answers with."""

    def __init__(self, **replies):
        super().__init__()
        self.lora_calls, self.replies = [], replies

    async def lora(self, kind, lora_name="", lora_path="", timeout=120.0):
        self.lora_calls.append((kind, lora_name, lora_path))
        return LoRAReply("r1", **self.replies.get(kind, {"ok": True}))


def run_against(tokenizer, lora, requests, engine=None):
    """POST each (route, raw body) to an API with ``lora``; [(status, json or text)]."""
    async def main():
        async with api_server(tokenizer, engine=engine, lora=lora) as (url, _):
            out = []
            async with aiohttp.ClientSession() as http:
                for route, raw in requests:
                    async with http.post(url + route, data=raw,
                                         headers={"Content-Type": "application/json"}) as r:
                        text = await r.text()
                        try:
                            out.append((r.status, json.loads(text)))
                        except ValueError:
                            out.append((r.status, text))
            return out
    return asyncio.run(main())


@pytest.fixture
def allowed(tmp_path):
    (tmp_path / "allowed" / "sql").mkdir(parents=True)
    return tmp_path / "allowed"


def config(allowed, **kw):
    return LoRAConfig(**{"enable_lora": True, "allow_runtime_updates": True,
                         "allowed_paths": (str(allowed),), **kw})


@pytest.mark.parametrize("kw", [dict(allow_runtime_updates=False),
                                dict(enable_lora=False)], ids=["updates-off", "lora-off"])
def test_the_routes_exist_only_with_runtime_updates(allowed, kw, smollm_tokenizer):
    engine = LoRAEngine()
    body = json.dumps({"lora_name": "sql", "lora_path": str(allowed / "sql")})
    got = run_against(smollm_tokenizer, config(allowed, **kw), [
        ("/v1/load_lora_adapter", body), ("/v1/unload_lora_adapter", body)], engine)
    assert [status for status, _ in got] == [404, 404]
    assert engine.lora_calls == []


@pytest.mark.parametrize("raw,param", [
    ("not json", None),
    ("[1, 2]", None),
    ("{}", "lora_name"),
    ('{"lora_name": 7, "lora_path": "x"}', "lora_name"),
    ('{"lora_name": "", "lora_path": "x"}', "lora_name"),
    ('{"lora_name": "' + "n" * 300 + '", "lora_path": "x"}', "lora_name"),
    ('{"lora_name": "folio-tiny", "lora_path": "ALLOWED/sql"}', "lora_name"),
    ('{"lora_name": "sql"}', "lora_path"),
    ('{"lora_name": "sql", "lora_path": ["ALLOWED/sql"]}', "lora_path"),
    ('{"lora_name": "sql", "lora_path": "ALLOWED/sql\\u0000"}', "lora_path"),
    ('{"lora_name": "sql", "lora_path": "ALLOWED/../sql"}', "lora_path"),
], ids=["not-json", "not-object", "no-name", "name-not-string", "empty-name", "long-name",
        "base-model-name", "no-path", "path-not-string", "nul-in-path", "dotdot"])
def test_malformed_loads_are_400_in_openais_shape_and_never_reach_the_engine(
        allowed, raw, param, smollm_tokenizer):
    engine = LoRAEngine()
    [(status, body)] = run_against(smollm_tokenizer, config(allowed), [
        ("/v1/load_lora_adapter", raw.replace("ALLOWED", str(allowed)))], engine)
    assert status == 400, body
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param and body["error"]["message"]
    assert str(allowed) not in body["error"]["message"]
    assert engine.lora_calls == []


def test_a_good_load_reaches_the_engine_with_the_resolved_path(allowed, tmp_path,
                                                                smollm_tokenizer):
    (tmp_path / "link").symlink_to(allowed / "sql")  # outside, pointing inside: allowed
    engine = LoRAEngine()
    got = run_against(smollm_tokenizer, config(allowed), [
        ("/v1/load_lora_adapter", json.dumps({"lora_name": "sql",
                                              "lora_path": str(tmp_path / "link")})),
        ("/v1/unload_lora_adapter", json.dumps({"lora_name": "sql"}))], engine)
    assert [status for status, _ in got] == [200, 200]
    assert engine.lora_calls == [("load", "sql", str((allowed / "sql").resolve())),
                                 ("unload", "sql", "")]


def test_the_engines_refusals_are_400_and_404(allowed, smollm_tokenizer):
    engine = LoRAEngine(
        load={"ok": False, "code": "bad_adapter", "message": "DoRA adapters are not supported"},
        unload={"ok": False, "code": "not_found", "message": "no adapter named 'sql'"})
    got = run_against(smollm_tokenizer, config(allowed), [
        ("/v1/load_lora_adapter", json.dumps({"lora_name": "sql",
                                              "lora_path": str(allowed / "sql")})),
        ("/v1/unload_lora_adapter", json.dumps({"lora_name": "sql"}))], engine)
    (load_status, load), (unload_status, unload) = got
    assert load_status == 400 and load["error"]["param"] == "lora_path"
    assert load["error"]["message"] == "DoRA adapters are not supported"
    assert unload_status == 404 and unload["error"]["code"] == "model_not_found"
    assert unload["error"]["param"] == "lora_name"


def test_an_adapter_name_without_lora_is_a_404_and_with_lora_reaches_the_engine(
        allowed, smollm_tokenizer):
    body = json.dumps({"model": "sql", "prompt": [5, 6], "max_tokens": 2})
    off = LoRAEngine()
    [(status, err)] = run_against(smollm_tokenizer, LoRAConfig(),
                                  [("/v1/completions", body)], off)
    assert status == 404 and err["error"]["param"] == "model" and off.added == []
    on = LoRAEngine()
    [(status, _)] = run_against(smollm_tokenizer, config(allowed),
                                [("/v1/completions", body)], on)
    assert status == 200 and on.lora_names == ["sql"]


def test_models_lists_adapters_with_the_base_as_parent(allowed, smollm_tokenizer):
    engine = LoRAEngine(list={"ok": True, "adapters": [LoRAAdapterInfo("sql", 1)]})

    async def main():
        async with api_server(smollm_tokenizer, engine=engine,
                              lora=config(allowed)) as (url, _):
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/v1/models") as r:
                    return [(m["id"], m["parent"]) for m in (await r.json())["data"]]
    assert asyncio.run(main()) == [(MODEL, None), ("sql", MODEL)]
