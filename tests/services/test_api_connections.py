"""Issue 14: hostile clients at the connection level of the API process.

Real sockets on 127.0.0.1 against the real APIServer and serve_api (over a fake
engine), with deadlines of a fraction of a second: a slowloris head, an idle
keep-alive connection and a trickled body are closed (408 where nothing was answered
yet) and counted in /metrics; a connection over ``max_connections`` and a body over
the process's body budget get 503 before anything is read; ``Transfer-Encoding``
codings other than chunked get 501; ``Expect: 100-continue`` is answered 100 only
when the request would be served; a key twice in a JSON object is a 400 naming it.

Timing bounds are wide on purpose (the machine is shared): a deadline must not fire
much before its time, and must fire within seconds, where today's server waits for
an hour (keep-alive) or for ever.
"""
import asyncio
import json
import re
import time

import aiohttp
import pytest
from structlog.testing import capture_logs

from config.schema import APIConfig, ConfigError
from services.api.connection_guard import ConnectionGuard
from services.api.request_body import parse_json_object
from services.protocol import QueueState
from tests.services.api_harness import api_server, raw_exchange

KEY = "sk-conn-test-0123456789"
GOOD = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
LATE = 4.0  # a deadline that has not fired by now has failed (the longest is 0.6 s)


def post_head(length: int | None = None, extra: bytes = b"",
              path: bytes = b"/v1/completions") -> bytes:
    framing = b"Content-Length: %d\r\n" % length if length is not None else b""
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + framing + extra + b"\r\n")


async def connect(url: str):
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_response(reader, timeout: float = LATE) -> tuple[int, bytes, bytes]:
    """(status, head, body) of the next response on the connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    body = await asyncio.wait_for(reader.readexactly(int(length.group(1))), timeout
                                  ) if length else b""
    return int(head.split(b" ", 2)[1]), head, body


async def wait_closed(reader, timeout: float = LATE) -> bytes:
    """Everything the server still sends until it closes the connection."""
    data = b""
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


async def metrics(url: str, headers=None) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics", headers=headers or {}) as r:
            assert r.status == 200, await r.text()
            text = await r.text()
    assert "# no metrics" in text  # the engine core's part comes first, untouched
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def until(check, within: float = LATE) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def closed_total(m: dict, reason: str) -> float:
    return m[f'folio:api_connections_closed_total{{reason="{reason}"}}']


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_slowloris_head_is_closed_while_a_good_client_is_served(smollm_tokenizer):
    api = APIConfig(header_timeout_s=0.6, keepalive_timeout_s=30)

    async def trickle(writer, head: bytes):
        try:
            for i in range(len(head)):
                writer.write(head[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0.1)
        except ConnectionError:
            pass

    async def main():
        async with api_server(smollm_tokenizer, api) as (url, engine):
            reader, writer = await connect(url)
            started = time.monotonic()
            sender = asyncio.create_task(trickle(writer, post_head(
                len(GOOD), b"X-Slow: " + b"a" * 200 + b"\r\n")))
            t0 = time.monotonic()
            status, _ = await raw_exchange(url, post_head(len(GOOD)) + GOOD)
            assert status == 200 and time.monotonic() - t0 < LATE  # served meanwhile
            rest = await wait_closed(reader)
            elapsed = time.monotonic() - started
            assert 0.5 <= elapsed < LATE, elapsed  # counted from the first byte
            assert rest.startswith(b"HTTP/1.1 408 ")
            assert error_of(rest.split(b"\r\n\r\n", 1)[1])["code"] == "request_timeout"
            sender.cancel()
            writer.close()
            m = await metrics(url)
            assert closed_total(m, "header_timeout") == 1
            assert len(engine.added) == 1
    asyncio.run(main())


def test_idle_connections_are_closed_after_keepalive_timeout(smollm_tokenizer):
    api = APIConfig(keepalive_timeout_s=0.5, header_timeout_s=30)

    async def main():
        async with api_server(smollm_tokenizer, api) as (url, engine):
            kept_reader, kept_writer = await connect(url)  # one request, then idle
            kept_writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, head, _ = await read_response(kept_reader)
            assert status == 200 and b"close" not in head.lower()
            answered = time.monotonic()
            silent_reader, silent_writer = await connect(url)  # never sends a byte
            assert await wait_closed(kept_reader) == b""
            assert 0.4 <= time.monotonic() - answered < LATE
            assert await wait_closed(silent_reader) == b""
            m = await metrics(url)
            assert closed_total(m, "idle") == 2
            assert m["folio:api_open_connections"] == 1  # the scrape's own
            kept_writer.close()
            silent_writer.close()
    asyncio.run(main())


def test_slow_body_gets_408_its_memory_is_released_and_drain_does_not_wait(
        smollm_tokenizer):
    api = APIConfig(body_timeout_s=0.6, max_body_bytes=200_000)
    body = b'{"prompt": "' + b"a" * (100_000 - 14) + b'"}'
    assert len(body) == 100_000

    async def main():
        async with api_server(smollm_tokenizer, api) as (url, engine):
            reader, writer = await connect(url)
            writer.write(post_head(len(body)) + body[:-1])  # all but the last byte
            await writer.drain()
            started = time.monotonic()

            async def reserved():
                m = await metrics(url)
                return m["folio:api_buffered_body_bytes"] == 100_000
            await until(reserved)
            async with aiohttp.ClientSession() as s:  # a drain would not wait for it
                async with s.get(url + "/health") as r:
                    assert (await r.json())["api"]["num_in_flight"] == 0
            status, head, answer = await read_response(reader)
            assert 0.5 <= time.monotonic() - started < LATE
            assert status == 408 and b"connection: close" in head.lower()
            assert error_of(answer)["code"] == "request_timeout"
            assert await wait_closed(reader) == b""
            writer.close()

            async def released():
                m = await metrics(url)
                return m["folio:api_buffered_body_bytes"] == 0
            await until(released)
            assert closed_total(await metrics(url), "body_timeout") == 1
            assert engine.added == []
    asyncio.run(main())


def test_the_connection_past_max_connections_gets_503(smollm_tokenizer):
    api = APIConfig(max_connections=3)

    async def main():
        async with api_server(smollm_tokenizer, api) as (url, engine):
            conns = [await connect(url) for _ in range(3)]
            for reader, writer in conns:  # each one is served, then stays open
                writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await read_response(reader))[0] == 200
            reader, writer = await connect(url)
            status, head, body = await read_response(reader)
            assert status == 503 and b"retry-after: 1" in head.lower()
            assert error_of(body)["code"] == "too_many_connections"
            assert await wait_closed(reader) == b""
            writer.close()
            first_reader, first_writer = conns[0]
            first_writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, text = await read_response(first_reader)
            assert status == 200
            assert b'folio:api_connections_closed_total{reason="over_limit"} 1.0' in text
            assert b"folio:api_open_connections 3.0" in text
            for _, w in conns:
                w.close()
            await asyncio.sleep(0.2)  # their slots come back
            assert (await raw_exchange(url, post_head(len(GOOD)) + GOOD))[0] == 200
    asyncio.run(main())


def test_a_spent_body_budget_is_503_before_the_body_is_read(smollm_tokenizer):
    api = APIConfig(max_body_bytes=100_000, max_buffered_body_bytes=150_000)

    async def main():
        async with api_server(smollm_tokenizer, api) as (url, engine):
            slow_reader, slow_writer = await connect(url)  # holds 100 000 of 150 000
            slow_writer.write(post_head(100_000) + b'{"prompt": "')
            await slow_writer.drain()

            async def reserved():
                m = await metrics(url)
                return m["folio:api_buffered_body_bytes"] == 100_000
            await until(reserved)
            # declared: answered with no body sent at all
            status, body = await raw_exchange(url, post_head(60_000))
            assert status == 503 and error_of(body)["code"] == "body_buffer_full"
            reader, writer = await connect(url)
            writer.write(post_head(60_000))
            status, head, _ = await read_response(reader)
            assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
            writer.close()
            # chunked: refused as it grows past what is left
            chunk = b"a" * 60_000
            status, body = await raw_exchange(url, post_head(
                extra=b"Transfer-Encoding: chunked\r\n") + b"%x\r\n%s\r\n" % (
                len(chunk), chunk))
            assert status == 503 and error_of(body)["code"] == "body_buffer_full"
            m = await metrics(url)
            assert m["folio:api_body_budget_refusals_total"] == 3
            assert m["folio:api_buffered_body_bytes"] == 100_000  # the refused held none
            slow_writer.close()  # the budget comes back with the slow client's leaving
            padded = GOOD + b" " * (60_000 - len(GOOD))
            await until(lambda: _status_is(url, post_head(len(padded)) + padded, 200))
            assert engine.added and len(engine.added) == 1
    asyncio.run(main())


async def _status_is(url: str, raw: bytes, want: int) -> bool:
    status, body = await raw_exchange(url, raw)
    assert status in (want, 503), body[:200]
    return status == want


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"GZIP, Chunked", b"deflate,chunked",
                                    b"x-custom, chunked",
                                    b"gzip"])  # gzip alone: the parser's refusal, mapped
def test_transfer_codings_other_than_chunked_get_501(smollm_tokenizer, coding):
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)

    def with_coding(value: bytes) -> bytes:
        return post_head(extra=b"Transfer-Encoding: " + value + b"\r\n") + chunked

    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            status, body = await raw_exchange(url, with_coding(coding))
            assert status == 501, body[:300]
            assert error_of(body)["code"] == "unsupported_transfer_encoding"
            assert engine.added == []
            # chunked not last breaks the framing itself: 400 (RFC 9112, 6.3)
            assert (await raw_exchange(url, with_coding(b"chunked, gzip")))[0] == 400
            for fine in (b"chunked", b"Chunked", b"identity, chunked"):
                status, body = await raw_exchange(url, with_coding(fine))
                assert status == 200, (fine, body[:300])
    asyncio.run(main())


EXPECT = b"Expect: 100-continue\r\n"
AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"


@pytest.mark.parametrize("case,head,status", [
    ("no-key", post_head(len(GOOD), EXPECT), 401),
    ("wrong-key", post_head(len(GOOD), EXPECT + b"Authorization: Bearer sk-no\r\n"), 401),
    ("too-large", post_head(5_000_000, EXPECT + AUTH), 413),
    ("queue-full", post_head(len(GOOD), EXPECT + AUTH), 503),
    ("unknown-expectation", post_head(len(GOOD), b"Expect: 200-ok\r\n" + AUTH), 417),
])
def test_expect_continue_refused_at_once_without_100(smollm_tokenizer, case, head, status):
    async def main():
        async with api_server(smollm_tokenizer, keys=(KEY,)) as (url, engine):
            engine.queue_state = QueueState(is_full=case == "queue-full")
            reader, writer = await connect(url)
            writer.write(head)  # and waits: the body goes only after a 100
            got, first_head, body = await read_response(reader)
            assert got == status, body[:300]
            assert b"100 Continue" not in first_head
            assert b"connection: close" in first_head.lower()
            error_of(body)
            assert await wait_closed(reader) == b""
            writer.close()
            assert engine.added == []
    asyncio.run(main())


def test_expect_continue_100_only_once_the_request_would_be_served(smollm_tokenizer):
    async def main():
        async with api_server(smollm_tokenizer, keys=(KEY,)) as (url, engine):
            reader, writer = await connect(url)  # no key: the final answer at once
            writer.write(post_head(len(GOOD), EXPECT))
            assert (await read_response(reader))[0] == 401
            writer.close()
            reader, writer = await connect(url)
            writer.write(post_head(len(GOOD), EXPECT + AUTH))
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), LATE)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(GOOD)
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["choices"], body[:300]
            writer.close()
            assert len(engine.added) == 1
    asyncio.run(main())


@pytest.mark.parametrize("raw,param", [
    ('{"prompt": "a", "max_tokens": 1, "max_tokens": 50}', "max_tokens"),
    ('{"prompt": "a", "prompt": [1, 2]}', "prompt"),
    ('{"messages": [{"role": "user", "content": "hi", "role": "system"}]}', "role"),
    ('{"prompt": "a", "stream_options": {"x": {"y": 1, "y": 2}}}', "y"),
])
def test_duplicate_json_keys_are_400_naming_the_key(smollm_tokenizer, raw, param):
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"

    async def main():
        async with api_server(smollm_tokenizer) as (url, engine):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + path, data=raw,
                                  headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 400
                    err = error_of(await r.read())
            assert err["param"] == param and param in err["message"]
            assert engine.added == []
    asyncio.run(main())


def test_duplicate_key_check_keeps_the_body_guarantees():
    from services.api.openai_protocol import APIError
    with pytest.raises(APIError) as e:  # a lone-surrogate key is named, never echoed raw
        parse_json_object(b'{"\\ud800": 1, "\\ud800": 2}')
    assert e.value.param is None and "\\ud800" in e.value.message
    assert parse_json_object(b'{"a": NaN, "b": {"a": 1}}')["b"] == {"a": 1}
    with pytest.raises(APIError, match="nested too deeply"):
        parse_json_object(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


@pytest.fixture
def debug_level():
    """Debug lines reach capture_logs whatever level an earlier test configured (the
    level filter is structlog's wrapper class, which capture_logs leaves in place)."""
    import logging

    import structlog
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    yield
    structlog.configure(**saved)


def test_closes_are_logged_one_line_per_reason_per_interval(debug_level):
    async def main():
        guard = ConnectionGuard(APIConfig(), log_interval_s=0.3)
        with capture_logs() as logs:
            for _ in range(500):
                guard.closed("header_timeout")
            guard.closed("idle")
            assert len(logs) == 2  # the first of each kind at once
            await asyncio.sleep(0.6)
        lines = [(e["reason"], e["num_events"]) for e in logs]
        assert lines == [("header_timeout", 1), ("idle", 1), ("header_timeout", 499)]
        assert guard.num_closed["header_timeout"] == 500
    asyncio.run(main())


@pytest.mark.parametrize("field,value", [
    ("header_timeout_s", 0), ("body_timeout_s", -1), ("keepalive_timeout_s", 0),
    ("max_connections", 0), ("max_buffered_body_bytes", 1024)])
def test_bad_connection_limits_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=f"api.{field}"):
        APIConfig(**{field: value})


def test_routine_idle_closes_are_debug_lines_and_an_idle_flood_warns(debug_level):
    async def main():
        guard = ConnectionGuard(APIConfig(), log_interval_s=0.3)
        with capture_logs() as logs:
            guard.closed("idle")
            await asyncio.sleep(0.4)
            for _ in range(150):
                guard.closed("idle")
            await asyncio.sleep(0.4)
        levels = [(e["log_level"], e["num_events"]) for e in logs]
        assert levels == [("debug", 1), ("debug", 1), ("warning", 149)]
    asyncio.run(main())
