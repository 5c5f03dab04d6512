"""SSE framing: exact bytes and stream headers."""

from __future__ import annotations


import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from supervisor.http import sse
from supervisor.http.errors import APIError, error_middleware, install_request_id


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


def test_characters_clients_split_lines_on_are_escaped():
    """U+0085, U+2028 and U+2029 are line ends to str.splitlines (httpx's iter_lines) and
    to older JavaScript: written raw they would cut an event in two (the fuzz suite found
    it through a tool schema echoed in a Responses stream)."""
    text = "a\x85b\u2028c\u2029d é"
    line = sse.encode_event({"t": text})
    body = line.decode("utf-8")
    assert len(body.removesuffix("\n\n").splitlines()) == 1 and body.endswith("\n\n")
    assert json.loads(body[len("data: "):]) == {"t": text}
    assert "é".encode() in line  # other text stays as UTF-8


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


def test_events_share_one_json_encoder(monkeypatch):
    # json.dumps with arguments of its own would build an encoder per event (issue 36).
    made = []
    init = json.JSONEncoder.__init__
    monkeypatch.setattr(json.JSONEncoder, "__init__",
                        lambda self, *a, **kw: (made.append(1), init(self, *a, **kw))[1])
    assert sse.encode_event({"t": "é"}) + sse.encode_event([1]) == \
        'data: {"t":"é"}\n\ndata: [1]\n\n'.encode()
    assert not made
