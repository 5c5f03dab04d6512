"""SSE framing: exact bytes, and the keep-alive pinger on a quiet stream."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from supervisor.api import sse
from supervisor.errors import APIError, error_middleware, install_request_id


def test_constants():
    assert sse.DONE == b"data: [DONE]\n\n"
    assert sse.PING == b": ping\n\n"


def test_encode_event_is_one_compact_line():
    assert sse.encode_event({"a": 1, "b": [1, 2], "c": None}) == \
        b'data: {"a":1,"b":[1,2],"c":null}\n\n'
    # newlines inside strings are escaped, so an event never spans lines; UTF-8 as is
    assert sse.encode_event({"t": "x\ny\r\nz é"}) == \
        'data: {"t":"x\\ny\\r\\nz é"}\n\n'.encode()
    with pytest.raises(ValueError):
        sse.encode_event({"x": float("nan")})


def test_error_event():
    err = APIError.worker_failed("gone")
    assert sse.error_event(err) == (
        b'data: {"error":{"message":"gone","type":"server_error","param":null,'
        b'"code":"worker_failed"}}\n\n')


def _app(handler) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    install_request_id(app)
    app.router.add_post("/s", handler)
    return app


async def test_event_stream_pings_when_quiet():
    async def handler(request):
        resp = await sse.open_stream(request)
        async with sse.EventStream(resp, ping_interval=0.05) as events:
            await events.send_event({"n": 1})
            await asyncio.sleep(0.18)  # quiet: expect pings
            await events.send_event({"n": 2})
            await events.send_error(APIError.timeout("slow"))
            await events.send_done()
        await resp.write_eof()
        return resp

    async with TestClient(TestServer(_app(handler))) as client:
        resp = await client.post("/s")
        body = await resp.read()
    frames = body.split(b"\n\n")[:-1]
    assert frames[0] == b'data: {"n":1}'
    pings = frames[1:-3]
    assert 2 <= len(pings) <= 4 and set(pings) == {b": ping"}
    assert frames[-3] == b'data: {"n":2}'
    assert frames[-2].startswith(b'data: {"error":')
    assert frames[-1] == b"data: [DONE]"


async def test_event_stream_no_ping_when_busy():
    async def handler(request):
        resp = await sse.open_stream(request)
        async with sse.EventStream(resp, ping_interval=0.1) as events:
            for i in range(8):
                await events.send_event({"n": i})
                await asyncio.sleep(0.02)
        return resp

    async with TestClient(TestServer(_app(handler))) as client:
        body = await (await client.post("/s")).read()
    assert b"ping" not in body and body.count(b"data: ") == 8


async def test_event_stream_stops_pinging_on_exit():
    async def handler(request):
        resp = await sse.open_stream(request)
        async with sse.EventStream(resp, ping_interval=0.02) as events:
            pinger = events._pinger
        assert pinger.done() and events._pinger is None
        await asyncio.sleep(0.08)  # would have pinged if still running
        await resp.write(sse.DONE)
        return resp

    async with TestClient(TestServer(_app(handler))) as client:
        assert await (await client.post("/s")).read() == sse.DONE


async def test_open_stream_extra_headers():
    async def handler(request):
        resp = await sse.open_stream(request, headers={"X-Extra": "1"})
        await resp.write(sse.DONE)
        return resp

    async with TestClient(TestServer(_app(handler))) as client:
        resp = await client.post("/s")
        await resp.read()
    assert resp.headers["X-Extra"] == "1"
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Connection"].lower() == "keep-alive"
