"""Issue 6, item 3: body size, header size and count, and Content-Length framing.

Each limit comes from the YAML's ``api`` section and answers in OpenAI's JSON shape:
413 for a body over ``max_body_bytes`` (at once from the Content-Length, before a
byte of body is read; while reading when the body is chunked), 431 for a request line
or header over ``max_header_bytes`` or more than ``max_headers`` fields, 400 for a
negative, non-numeric, overflowing or duplicated Content-Length.
"""
import asyncio
import json

import pytest

from config.schema import APIConfig
from tests.services.api_harness import api_server, raw_exchange

LIMITS = APIConfig(max_body_bytes=4096, max_header_bytes=1024, max_headers=16)
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
GOOD = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()


def request(extra_headers: bytes = b"", body: bytes = GOOD, length: bytes | None = None):
    length = str(len(body)).encode() if length is None else length
    return HEAD + extra_headers + b"Content-Length: " + length + b"\r\n\r\n" + body


def chunked(body: bytes, size: int = 1000) -> bytes:
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                      for i in range(0, len(body), size))
    return HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


def error_of(status: int, body: bytes) -> tuple[int, dict]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert b"aaaa" not in body  # never echoes what it refused
    return status, err


CASES = {  # id → (raw request, status)
    "declared-body-too-large-nothing-sent": (request(body=b"", length=b"1000000000"), 413),
    "declared-just-over": (request(body=b"x" * 4097), 413),
    "chunked-body-too-large": (chunked(b'{"prompt": "' + b"a" * 6000 + b'"}'), 413),
    "negative-content-length": (request(length=b"-5"), 400),
    "non-numeric-content-length": (request(length=b"abc"), 400),
    "overflowing-content-length": (request(length=b"9" * 30), 400),
    "duplicate-content-length": (HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
                                 400),
    "header-value-too-long": (request(b"X-Big: " + b"a" * 2000 + b"\r\n"), 431),
    "header-name-too-long": (request(b"X-" + b"a" * 2000 + b": 1\r\n"), 431),
    "too-many-headers": (request(b"".join(b"X-H%d: 1\r\n" % i for i in range(30))), 431),
    "request-line-too-long": (b"GET /v1/models?" + b"a" * 2000 + b" HTTP/1.1\r\n"
                              b"Host: x\r\n\r\n", 431),
}


@pytest.mark.parametrize("raw,status", CASES.values(), ids=CASES.keys())
def test_limits_answer_openai_json(smollm_tokenizer, raw, status):
    async def main():
        async with api_server(smollm_tokenizer, LIMITS) as (url, engine):
            got, err = error_of(*await raw_exchange(url, raw, read_timeout=3.0))
            assert got == status, err
            if status == 413:
                assert err["code"] == "request_too_large"
            # the server is fine afterwards, and the limits let normal requests through
            ok, body = await raw_exchange(url, request(
                b"".join(b"X-H%d: 1\r\n" % i for i in range(8)) + b"X-Big: " + b"b" * 900
                + b"\r\n", body=GOOD + b" " * (4096 - len(GOOD))))
            assert ok == 200, body[:300]
            assert len(engine.added) == 1  # only the good request reached the engine
    asyncio.run(main())


def test_413_comes_before_the_body_and_the_connection_is_not_kept(smollm_tokenizer):
    """A client declaring 1 GB gets its 413 while it has sent no body at all, and the
    server reads no more than a first chunk of a body it refuses."""
    async def main():
        async with api_server(smollm_tokenizer, LIMITS) as (url, engine):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request(body=b"", length=b"1000000000"))
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3.0)
            assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head
            writer.close()
            assert engine.added == []
    asyncio.run(main())


def test_a_body_with_too_many_json_values_is_refused_before_parsing(smollm_tokenizer):
    """Issue 14: 4 MiB of ``stop_token_ids`` (two million items) cost the event loop
    166 ms of json.loads per request; past ``max_json_values`` it is a 400 without a
    parse, while commas inside strings never count."""
    limits = APIConfig(max_json_values=1024, max_body_bytes=1 << 20)
    ids = ",".join(["1"] * 5000)
    flood = b'{"prompt": "Hi", "stop_token_ids": [' + ids.encode() + b"]}"
    commas = json.dumps({"prompt": "Hi", "user": "a, " * 5000 + "\\\",",
                         "max_tokens": 2}).encode()

    async def main():
        async with api_server(smollm_tokenizer, limits) as (url, engine):
            status, err = error_of(*await raw_exchange(url, request(body=flood)))
            assert status == 400 and "max_json_values" in err["message"]
            ok, body = await raw_exchange(url, request(body=commas))
            assert ok == 200, body[:300]
            assert len(engine.added) == 1
    asyncio.run(main())


@pytest.mark.parametrize("few_quotes", [0, 10**9])  # strings removed / counted one by one
@pytest.mark.parametrize("text,refused", [
    ("[" + ",".join(["1"] * 2000) + "]", True),
    ('{"a": [' + ",".join(["1"] * 1023) + "]}", False),
    (json.dumps(["x,y" * 3, ',"' * 600, "\\" * 5] * 200), False),  # 599 values
    (json.dumps(["x,y"] * 1100), True),
])
def test_value_count_ignores_commas_in_strings(text, refused, few_quotes, monkeypatch):
    from services.api import request_body
    from services.api.openai_protocol import APIError
    from services.api.request_body import check_value_count
    monkeypatch.setattr(request_body, "FEW_QUOTES", few_quotes)
    if refused:
        with pytest.raises(APIError):
            check_value_count(text, 1024)
    else:
        check_value_count(text, 1024)
