"""`folio bench serve`'s client against a server that closes keep-alive connections
after a few requests without saying so (as llama.cpp's cpp-httplib does): a stale
pooled connection is the client's business, never counted as a server failure."""
import asyncio
import json

from folio.bench.serve import LoadSpec, run_load
from folio.bench.workload import BenchRequest

REQUESTS_PER_CONNECTION = 2


async def _serve_one(reader, writer, served: list, per_connection: int) -> None:
    """Answer ``per_connection`` streamed completions on a connection, then drop it at the
    next one."""
    for count in range(per_connection + 1):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the client closed it (a one-off connection)
            return
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        if count == per_connection:
            writer.close()  # the client believes this connection is still alive
            return
        events = [{"choices": [{"text": "hi", "index": 0}]},
                  {"choices": [], "usage": {"completion_tokens": 1}}]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        body += b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        served.append(1)


def _run(num_requests: int, concurrency: int, per_connection: int = REQUESTS_PER_CONNECTION):
    async def main():
        served = []
        server = await asyncio.start_server(
            lambda r, w: _serve_one(r, w, served, per_connection), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        requests = [BenchRequest(prompt="x", prompt_len=1, output_len=1)] * num_requests
        async with server:
            records, _, _ = await run_load(f"http://127.0.0.1:{port}", "m", requests,
                                        LoadSpec(max_concurrency=concurrency))
        return records, served

    return asyncio.run(main())


def test_stale_keepalive_connections_are_retried_not_counted_as_failures():
    records, served = _run(40, 1)
    assert [r.error for r in records if not r.success] == []
    assert len(served) == 40
    assert sum(r.num_retries for r in records) >= 10  # connections did go stale


def test_a_retry_never_takes_another_stale_connection_from_the_pool():
    """Four idle pooled connections, each of which the server drops at its next request
    (as llama-server did at 32 clients: one of 48 requests failed after three retries
    through the pool): the request still succeeds, its retry on a connection of its own."""
    import aiohttp
    from folio.bench.serve import STALE_CONNECTION_RETRIES, _one

    async def main():
        served = []
        server = await asyncio.start_server(lambda r, w: _serve_one(r, w, served, 1),
                                            "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        req = BenchRequest(prompt="x", prompt_len=1, output_len=1)
        async with server, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0)) as session:
            first = await asyncio.gather(*(_one(session, url, "m", req, True, {})
                                           for _ in range(STALE_CONNECTION_RETRIES + 1)))
            last = await _one(session, url, "m", req, True, {})
        return first, last, served

    first, last, served = asyncio.run(main())
    assert all(r.success for r in first)
    assert last.success, last.error
    assert last.num_retries >= 1 and len(served) == STALE_CONNECTION_RETRIES + 2
