"""Issue 6, item 9: API keys. Every route but the public ones answers 401 without the
right key, whatever the path looks like; keys are compared in constant time, come
from the YAML or FOLIO_API_KEYS, and never reach a log line or a span.
"""
import asyncio
import hashlib
import json

import aiohttp
import pytest
import structlog

from config.loader import config_to_dict, load_config
from config.schema import APIConfig
from observability.logging import configure_logging
from services.api import auth
from services.api.auth import APIKeys
from tests.services.api_harness import api_server, raw_exchange

KEY_A, KEY_B = "sk-tenant-a-0123456789abcdef", "sk-tenant-b-fedcba9876543210"
BODY = {"model": "folio-tiny", "prompt": "Hello", "max_tokens": 2}
ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/version"), ("GET", "/metrics"), ("GET", "/openapi.json"),
          ("GET", "/no/such/route"), ("DELETE", "/health"), ("POST", "/health")]
PATH_TRICKS = ["//v1/models", "/v1//models", "/v1/%6Dodels", "/%761/models", "/v1/../v1/models",
               "/health/../v1/models", "/health/%2e%2e/v1/models", "/health/..%2Fv1/models",
               "/./v1/models", "/health/", "/HEALTH", "/health%00", "/health;/v1/models",
               "/health%2F..%2Fv1%2Fmodels", "/v1/models/", "/v1/models%2F"]


def run(coro):
    return asyncio.run(coro)


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


async def call(s, url, method, path, headers=None):
    kw = {"json": BODY} if method == "POST" else {}
    async with s.request(method, url + path, headers=headers or {}, **kw) as r:
        return r.status, await r.read()


def test_every_route_but_health_needs_the_key(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer, keys=(KEY_A, KEY_B)) as (url, engine):
            async with aiohttp.ClientSession() as s:
                for method, path in ROUTES:
                    for headers in ({}, bearer("sk-wrong"), bearer(KEY_A + "x"),
                                    bearer(KEY_A[:-1]), {"Authorization": KEY_A},
                                    {"Authorization": f"Basic {KEY_A}"}, bearer("")):
                        status, body = await call(s, url, method, path, headers)
                        assert status == 401, (method, path, headers, body[:200])
                        err = json.loads(body)["error"]
                        assert err["type"] == "authentication_error"
                        assert KEY_A.encode() not in body
                assert (await call(s, url, "GET", "/health"))[0] == 200
                for key in (KEY_A, KEY_B):
                    assert (await call(s, url, "GET", "/v1/models", bearer(key)))[0] == 200
                    status, _ = await call(s, url, "POST", "/v1/completions",
                                           {"Authorization": f"bearer  {key} "})
                    assert status == 200
                assert (await call(s, url, "GET", "/no/such", bearer(KEY_A)))[0] == 404
        assert len(engine.added) == 2  # nothing unauthenticated reached the engine
    run(main())


def test_path_tricks_never_reach_a_private_route_without_a_key(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer, keys=(KEY_A,)) as (url, engine):
            for path in PATH_TRICKS:
                for method, body in (("GET", b""), ("POST", json.dumps(BODY).encode())):
                    raw = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: "
                           f"{len(body)}\r\nContent-Type: application/json\r\n\r\n"
                           ).encode() + body
                    status, reply = await raw_exchange(url, raw)
                    if status == 200:  # only the public handler may answer
                        assert json.loads(reply)["status"] == "ok", (path, reply[:200])
                    else:
                        assert status in (400, 401), (method, path, status, reply[:200])
                # the same paths with the key reach models (or 404): the router decides
                raw = f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n"
                status, _ = await raw_exchange(url, raw.encode())
                assert status in (200, 400, 404), (path, status)
                if path in ("/v1/%6Dodels", "/%761/models"):  # decoded, these ARE models
                    assert status == 200, path
        assert engine.added == []
    run(main())


def test_metrics_public_only_when_the_yaml_says_so(smollm_tokenizer):
    async def main():
        for public, want in ((False, 401), (True, 200)):
            async with api_server(smollm_tokenizer, APIConfig(public_metrics=public),
                                  keys=(KEY_A,)) as (url, _):
                async with aiohttp.ClientSession() as s:
                    assert (await call(s, url, "GET", "/metrics"))[0] == want
                    assert (await call(s, url, "GET", "/v1/models"))[0] == 401
    run(main())


def test_no_keys_means_open_and_no_salt(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                assert (await call(s, url, "POST", "/v1/completions"))[0] == 200
        assert engine.added[0][3] is None
    run(main())


def test_cache_salt_is_a_keyed_digest_per_tenant_the_same_in_every_process(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer, keys=(KEY_A, KEY_B)) as (url, engine):
            async with aiohttp.ClientSession() as s:
                for key in (KEY_A, KEY_B, KEY_A):
                    assert (await call(s, url, "POST", "/v1/completions", bearer(key)))[0] == 200
        return [added[3] for added in engine.added]

    salt_a, salt_b, salt_a2 = run(main())
    assert salt_a == salt_a2 and salt_a != salt_b
    for salt, key in ((salt_a, KEY_A), (salt_b, KEY_B)):
        assert len(salt) == 64 and key not in salt
        assert salt != hashlib.sha256(key.encode()).hexdigest()  # keyed, not a bare hash
    # another API process built from the same keys (any order) derives the same salts
    other = APIKeys.from_sources([KEY_B], {"FOLIO_API_KEYS": f" {KEY_A} ,"})
    assert other.cache_salt(other.tenant_of(f"Bearer {KEY_A}")) == salt_a


def test_keys_from_yaml_environment_and_config_env(tmp_path, monkeypatch):
    path = tmp_path / "folio.yaml"
    path.write_text(f"api:\n  api_keys: [{KEY_A}]\n")
    monkeypatch.setenv("FOLIO_API__API_KEYS", f"{KEY_B},k3")
    assert load_config(path, use_env=False).api.api_keys == (KEY_A,)
    assert load_config(path).api.api_keys == (KEY_B, "k3")
    keys = APIKeys.from_sources((KEY_A,), {"FOLIO_API_KEYS": f"{KEY_B}, k4", "OTHER": "x"})
    assert len(keys) == 3 and all(keys.tenant_of(f"Bearer {k}") for k in (KEY_A, KEY_B, "k4"))
    assert keys.tenant_of("Bearer k3") is None and not APIKeys([]).enabled


def test_comparison_is_constant_time_over_every_key(monkeypatch):
    keys = [f"key-{i}" * (i + 1) for i in range(5)]  # different lengths
    api_keys = APIKeys(keys)
    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for candidate in (keys[0], keys[4], "nope", keys[2][:-1]):
        calls.clear()
        api_keys.tenant_of(f"Bearer {candidate}")
        assert calls == [(32, 32)] * 5  # every key, always digests of one length


def test_keys_never_in_logs_spans_or_config_dumps(smollm_tokenizer, capsys):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    configure_logging("debug", "json")

    async def main():
        async with api_server(smollm_tokenizer, APIConfig(max_header_bytes=512), keys=(KEY_A,),
                              tracer=provider.get_tracer("test")) as (url, _):
            async with aiohttp.ClientSession() as s:
                for headers in (bearer(KEY_A), bearer(KEY_A + "-wrong"), bearer(KEY_A[:8])):
                    await call(s, url, "POST", "/v1/completions", headers)
                    await call(s, url, "POST", "/v1/chat/completions", headers)
                    await call(s, url, "GET", "/nope", headers)
            long_auth = f"Authorization: Bearer {KEY_A}{'x' * 600}\r\n"
            await raw_exchange(url, f"GET /v1/models HTTP/1.1\r\n{long_auth}\r\n".encode())
    try:
        run(main())
    finally:
        structlog.reset_defaults()
    logs = capsys.readouterr()
    assert "request received" in logs.err  # the logs were captured at debug level
    spans = exporter.get_finished_spans()
    assert spans
    dumped = logs.out + logs.err + "".join(json.dumps(dict(s.attributes)) + str(s.events)
                                           for s in spans)
    assert KEY_A not in dumped and KEY_A[:8] not in dumped
    config = load_config(overrides={"api.api_keys": [KEY_A]}, use_env=False)
    assert KEY_A not in repr(config) and KEY_A not in json.dumps(config_to_dict(config))
    assert KEY_A not in repr(APIKeys([KEY_A]))
    from folio.cli import main as folio_main
    assert folio_main(["config", "--set", f"api.api_keys={KEY_A}"]) == 0
    printed = capsys.readouterr().out
    assert "api_keys:" in printed and KEY_A not in printed


@pytest.mark.parametrize("bad", [[""], [" padded "], ["a,b"]])
def test_bad_keys_in_the_yaml_are_config_errors(bad):
    from config.schema import ConfigError
    with pytest.raises(ConfigError, match="api.api_keys"):
        APIConfig(api_keys=tuple(bad))


def test_each_key_is_a_tenant_with_its_configured_weight(smollm_tokenizer):
    """The fair scheduler's tenant: a stable public id per key, and its weight from
    api.tenant_weights (1 for keys it does not name); no keys, no tenant."""
    from services.tenants import key_digest, tenant_id
    tenant_a, tenant_b = tenant_id(key_digest(KEY_A)), tenant_id(key_digest(KEY_B))
    assert tenant_a != tenant_b and KEY_A not in tenant_a

    async def main():
        api = APIConfig(tenant_weights={tenant_a: 3.0})
        async with api_server(smollm_tokenizer, api, keys=(KEY_A, KEY_B)) as (url, engine):
            async with aiohttp.ClientSession() as s:
                for key in (KEY_A, KEY_B):
                    async with s.post(url + "/v1/completions", json=BODY,
                                      headers=bearer(key)) as r:
                        assert r.status == 200
            assert engine.tenants == [(tenant_a, 3.0), (tenant_b, 1.0)]
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json=BODY) as r:
                    assert r.status == 200
            assert engine.tenants == [(None, 1.0)]

    run(main())


def test_tenant_weights_from_yaml_env_and_set(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("api:\n  tenant_weights: {t-aaa: 2, t-bbb: 0.5}\n")
    assert load_config(path).api.tenant_weights == {"t-aaa": 2.0, "t-bbb": 0.5}
    monkeypatch.setenv("FOLIO_API__TENANT_WEIGHTS", "t-ccc=4")
    assert load_config(None).api.tenant_weights == {"t-ccc": 4.0}
    monkeypatch.delenv("FOLIO_API__TENANT_WEIGHTS")
    path.write_text("api:\n  tenant_weights: {t-aaa: 0}\n")
    with pytest.raises(Exception, match="api.tenant_weights"):
        load_config(path)
