"""`folio bench serve`'s client against a server that closes keep-alive connections
after a few requests without saying so (as llama.cpp's cpp-httplib does): a stale
pooled connection is the client's business, never counted as a server failure."""
import asyncio
import json

from folio.bench.serve import LoadSpec, run_load
from folio.bench.workload import BenchRequest

REQUESTS_PER_CONNECTION = 2


async def _serve_one(reader, writer, served: list) -> None:
    """Answer two streamed completions on a connection, then drop it at the next one."""
    for count in range(REQUESTS_PER_CONNECTION + 1):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        if count == REQUESTS_PER_CONNECTION:
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


def test_stale_keepalive_connections_are_retried_not_counted_as_failures():
    async def main():
        served = []
        server = await asyncio.start_server(lambda r, w: _serve_one(r, w, served),
                                            "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        requests = [BenchRequest(prompt="x", prompt_len=1, output_len=1)] * 40
        async with server:
            records, _, _ = await run_load(f"http://127.0.0.1:{port}", "m", requests,
                                        LoadSpec(max_concurrency=1))
        return records, served

    records, served = asyncio.run(main())
    assert [r.error for r in records if not r.success] == []
    assert len(served) == 40
    assert sum(r.num_retries for r in records) >= 10  # connections did go stale
