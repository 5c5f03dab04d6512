"""WebSocket mode's upgrade behind the guard (supervisor/http/guard.py) and its end on
shutdown (supervisor/api/responses/websocket.py), against the fake worker: a key is
needed when the server has one, a page of another site cannot open one (no CORS rule
stops a cross-site WebSocket), and an idle socket is closed with 1001 when the server
stops."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for

CREATE = json.dumps({"type": "response.create", "model": "fake", "input": "hi"})


async def one_response(ws) -> dict:
    await ws.send_str(CREATE)
    while True:
        event = json.loads((await asyncio.wait_for(ws.receive(), 10)).data)
        assert event["type"] != "error", event
        if event["type"] == "response.completed":
            return event["response"]


async def test_a_key_is_required_when_the_server_has_one():
    client = await client_for(FakeWorld(FakeBehaviour()), api_key=("k-one",))
    try:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect("/v1/responses", headers=headers)
            assert refused.value.status == 401
        async with client.ws_connect("/v1/responses",
                                     headers={"Authorization": "Bearer k-one"}) as ws:
            assert (await one_response(ws))["output"]
    finally:
        await client.close()


@pytest.mark.parametrize("origin,ok", [
    ("https://evil.example", False), ("http://localhost:3000", False),
    ("http://allowed.example", True),  # named with --cors-origin
    (None, True),  # not a browser
    ("own", True),  # a page this server served
])
async def test_pages_of_other_sites_cannot_open_one(origin, ok):
    client = await client_for(FakeWorld(FakeBehaviour()),
                              cors_origins=("http://allowed.example",))
    try:
        headers = {}
        if origin == "own":
            headers["Origin"] = f"http://{client.host}:{client.port}"
        elif origin is not None:
            headers["Origin"] = origin
        if not ok:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect("/v1/responses", headers=headers)
            assert refused.value.status == 403
            return
        async with client.ws_connect("/v1/responses", headers=headers) as ws:
            assert (await one_response(ws))["status"] == "completed"
    finally:
        await client.close()


async def test_an_idle_socket_is_closed_on_shutdown():
    client = await client_for(FakeWorld(FakeBehaviour()))
    ws = await client.ws_connect("/v1/responses")
    try:
        await one_response(ws)
        closing = asyncio.ensure_future(ws.receive())
        await client.app.shutdown()  # what aiohttp runs first when the server stops
        msg = await asyncio.wait_for(closing, 5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1001
    finally:
        await ws.close()
        await client.close()
