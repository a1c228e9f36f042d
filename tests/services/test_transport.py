"""WebSocket links over a real unix socket: round trips, 0600 mode, bad peers dropped."""
import asyncio
import stat

import aiohttp
from aiohttp import web

from services.protocol import AbortRequest, Health
from services.transport import Endpoint, connect, start_site, websocket_route


def run(coro):
    return asyncio.run(coro)


async def _echo_server(endpoint, seen):
    async def handler(link):
        async for message in link.messages():
            seen.append(message)
            await link.send(Health(True, {"echo_" + type(message).__name__: 1.0}))

    app = web.Application()
    app.router.add_get("/ws", websocket_route(handler, "test-peer"))
    return await start_site(app, endpoint)


def test_round_trip_and_socket_mode(tmp_path):
    async def main():
        endpoint = Endpoint(unix_path=str(tmp_path / "sock" / "engine.sock"))
        seen = []
        runner = await _echo_server(endpoint, seen)
        try:
            mode = stat.S_IMODE((tmp_path / "sock" / "engine.sock").stat().st_mode)
            assert mode == 0o600
            link, session = await connect(endpoint, "client")
            await link.send(AbortRequest(["a", "b"]))
            reply = await link.messages().__anext__()
            assert reply == Health(True, {"echo_AbortRequest": 1.0})
            assert seen == [AbortRequest(["a", "b"])]
            await link.close()
            await session.close()
        finally:
            await runner.cleanup()
    run(main())


def test_garbage_disconnects_the_peer_but_not_the_service(tmp_path):
    async def main():
        endpoint = Endpoint(unix_path=str(tmp_path / "engine.sock"))
        seen = []
        runner = await _echo_server(endpoint, seen)
        try:
            async with aiohttp.ClientSession(connector=endpoint.connector()) as s:
                ws = await s.ws_connect(endpoint.url())
                await ws.send_bytes(b"\x80\x04not-msgpack-but-pickle-ish")
                msg = await ws.receive()
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
                ws2 = await s.ws_connect(endpoint.url())
                await ws2.send_str("hello")
                assert (await ws2.receive()).type in (aiohttp.WSMsgType.CLOSE,
                                                      aiohttp.WSMsgType.CLOSED)
            link, session = await connect(endpoint, "client")  # still serving
            await link.send(Health())
            assert (await link.messages().__anext__()).detail == {"echo_Health": 1.0}
            await link.close()
            await session.close()
            assert seen == [Health()]
        finally:
            await runner.cleanup()
    run(main())


def test_connect_times_out_with_a_clear_error(tmp_path):
    async def main():
        try:
            await connect(Endpoint(unix_path=str(tmp_path / "nobody.sock")), "client",
                          timeout=0.2)
        except ConnectionError as e:
            assert "nothing listening" in str(e)
        else:
            raise AssertionError("connect should have failed")
    run(main())
