"""error_middleware, the X-Request-ID signal and read_json, through a tiny real aiohttp app."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from supervisor.http import sse
from supervisor.http.errors import (
    APIError, error_middleware, get_request_id, install, install_request_id, read_json,
)
from tests.schema import validate

MAX_BODY = 1024
HEX32 = re.compile(r"[0-9a-f]{32}")
routes = web.RouteTableDef()


@routes.get("/ok")
async def ok(request):
    return web.json_response({"ok": True, "rid": get_request_id(request)})


@routes.get("/api-error")
async def api_error(request):
    raise APIError.bad_request("Nope.", "temperature", "invalid_value")


@routes.get("/overloaded")
async def overloaded(request):
    raise APIError.overloaded("Busy.", retry_after_s=2.2)


@routes.get("/boom")
async def boom(request):
    raise RuntimeError("secret-internal-detail")


@routes.get("/forbidden")
async def forbidden(request):
    raise web.HTTPForbidden(text="no entry")


@routes.get("/redirect")
async def redirect(request):
    raise web.HTTPFound("/ok")


@routes.post("/echo")
async def echo(request):
    return web.json_response(await read_json(request))


@routes.post("/raw-json")
async def raw_json(request):
    return web.json_response(await request.json())  # aiohttp's own 413, not read_json's


@routes.post("/stream")
async def stream(request):
    resp = await sse.open_stream(request)
    await resp.write(sse.encode_event({"n": 1}))
    await resp.write(sse.DONE)
    await resp.write_eof()
    return resp


@routes.post("/stream-bug")
async def stream_bug(request):
    resp = await sse.open_stream(request)
    await resp.write(sse.encode_event({"n": 1}))
    raise RuntimeError("secret-internal-detail")


@routes.post("/stream-apierror")
async def stream_apierror(request):
    resp = await sse.open_stream(request)
    await resp.write(sse.encode_event({"n": 1}))
    raise APIError.worker_failed("Worker died; retry.")


@routes.get("/plain-started-bug")
async def plain_started_bug(request):
    resp = web.StreamResponse()
    resp.content_type = "application/json"
    await resp.prepare(request)
    await resp.write(b'{"partial": ')
    raise RuntimeError("secret-internal-detail")


@routes.get("/bad-header-stream")
async def bad_header_stream(request):
    # A header value the writer refuses: prepare() fails before anything is sent.
    resp = web.StreamResponse(headers={"X-Note": "a\x1fb"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    await resp.write(b"data: never\n\n")


def make_app() -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY)
    install_request_id(app)
    app.add_routes(routes)
    return app


@pytest.fixture
async def client():
    async with TestClient(TestServer(make_app())) as c:
        yield c


async def envelope(resp, status: int) -> dict:
    assert resp.status == status
    assert resp.content_type == "application/json"
    body = await resp.json()
    validate(body, "ErrorResponse", strict=True)
    assert HEX32.fullmatch(resp.headers["X-Request-ID"])
    return body["error"]


# ---- the envelope --------------------------------------------------------------------

async def test_success_passes_through(client):
    resp = await client.get("/ok")
    assert resp.status == 200
    body = await resp.json()
    assert body["ok"] is True and body["rid"] == resp.headers["X-Request-ID"]


async def test_api_error(client):
    err = await envelope(await client.get("/api-error"), 400)
    assert err == {"message": "Nope.", "type": "invalid_request_error",
                   "param": "temperature", "code": "invalid_value"}


async def test_api_error_headers(client):
    resp = await client.get("/overloaded")
    err = await envelope(resp, 503)
    assert resp.headers["Retry-After"] == "3"
    assert err["code"] == "overloaded" and err["type"] == "server_error"


async def test_unknown_route(client):
    err = await envelope(await client.post("/v1/nope"), 404)
    assert err["message"] == "Invalid URL (POST /v1/nope)"
    assert err["type"] == "invalid_request_error"


async def test_wrong_method(client):
    resp = await client.get("/echo")
    err = await envelope(resp, 405)
    assert resp.headers["Allow"] == "POST"
    assert "GET" in err["message"] and err["code"] == "method_not_allowed"


async def test_uncaught_exception_is_500_without_details(client, caplog):
    with caplog.at_level(logging.ERROR, logger="supervisor.http.errors"):
        resp = await client.get("/boom")
        text = await resp.text()
    err = await envelope(resp, 500)
    assert err["type"] == "server_error"
    assert "secret-internal-detail" not in text and "Traceback" not in text
    assert "RuntimeError" not in text
    # ... but the log has the traceback and the request id
    record = next(r for r in caplog.records if r.name == "supervisor.http.errors")
    assert record.exc_info and resp.headers["X-Request-ID"] in record.getMessage()


async def test_other_http_errors_keep_status(client):
    err = await envelope(await client.get("/forbidden"), 403)
    assert err["message"] == "no entry" and err["type"] == "invalid_request_error"


async def test_redirect_is_not_an_error(client):
    resp = await client.get("/redirect", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/ok"


async def test_cancellation_propagates():
    async def handler(request):
        raise asyncio.CancelledError
    with pytest.raises(asyncio.CancelledError):
        await error_middleware(make_mocked_request("GET", "/"), handler)


def test_install_wires_both():
    app = web.Application()
    install(app)
    assert app.middlewares[0] is error_middleware
    assert len(app.on_response_prepare) == 1


# ---- bodies ----------------------------------------------------------------------------

async def test_body_too_large(client):
    resp = await client.post("/echo", data=b'{"a": "' + b"x" * 2 * MAX_BODY + b'"}',
                             headers={"Content-Type": "application/json"})
    err = await envelope(resp, 413)
    assert str(MAX_BODY) in err["message"]
    resp = await client.post("/raw-json", data=b"[" + b"1," * MAX_BODY + b"1]")
    assert (await envelope(resp, 413))["message"] == err["message"]


@pytest.mark.parametrize("data", [b"{not json", b"", b"[1, 2]", b'"text"', b"null",
                                  b'{"t": NaN}', b"\xff\xfe\xfa"],
                         ids=["malformed", "empty", "array", "string", "null", "nan", "utf8"])
async def test_bad_json_is_400(client, data):
    err = await envelope(await client.post("/echo", data=data), 400)
    assert err["type"] == "invalid_request_error" and err["param"] is None


async def test_content_type_is_not_checked(client):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        resp = await client.post("/echo", data='{"a": "é"}'.encode(), headers=headers)
        assert resp.status == 200 and await resp.json() == {"a": "é"}


# ---- request ids -----------------------------------------------------------------------

async def test_request_id_echoed_when_sane(client):
    for path, method in (("/ok", "get"), ("/boom", "get"), ("/nowhere", "get"),
                         ("/stream", "post")):
        resp = await getattr(client, method)(path, headers={"X-Request-ID": "abc.DEF_1-2"})
        await resp.read()
        assert resp.headers["X-Request-ID"] == "abc.DEF_1-2", path


@pytest.mark.parametrize("given", ["has space", "x" * 129, "semi;colon", "ü"])
async def test_request_id_replaced_when_insane(client, given):
    resp = await client.get("/ok", headers={"X-Request-ID": given.encode().decode("latin-1")})
    body = await resp.json()
    assert HEX32.fullmatch(resp.headers["X-Request-ID"])
    assert body["rid"] == resp.headers["X-Request-ID"]


async def test_request_ids_are_unique(client):
    ids = set()
    for _ in range(3):
        resp = await client.get("/ok")
        ids.add(resp.headers["X-Request-ID"])
    assert len(ids) == 3


# ---- streams ---------------------------------------------------------------------------

async def test_stream_headers_and_bytes(client):
    resp = await client.post("/stream")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    assert HEX32.fullmatch(resp.headers["X-Request-ID"])
    assert await resp.read() == b'data: {"n":1}\n\n' + b"data: [DONE]\n\n"


async def test_bug_mid_stream_ends_with_error_event(client):
    resp = await client.post("/stream-bug")
    assert resp.status == 200  # the status line had gone out
    body = await resp.read()
    assert b"secret-internal-detail" not in body
    first, last = body.split(b"\n\n")[:2]
    assert first == b'data: {"n":1}'
    event = json.loads(last.removeprefix(b"data: "))
    validate(event, "ErrorResponse", strict=True)
    assert event["error"]["type"] == "server_error"


async def test_api_error_mid_stream_ends_with_error_event(client):
    resp = await client.post("/stream-apierror")
    body = await resp.read()
    assert body == (b'data: {"n":1}\n\n' + sse.error_event(APIError.worker_failed(
        "Worker died; retry.")))


async def test_bug_in_started_plain_body_drops_connection(client):
    resp = await client.get("/plain-started-bug")
    assert resp.status == 200
    with pytest.raises(aiohttp.ClientError):
        await resp.read()  # never a clean end to a truncated JSON body


async def test_a_prepare_that_fails_on_its_headers_drops_the_connection(client):
    # No status line went out, so no SSE error event may follow (a client would read
    # it as a garbled response): the connection is dropped, and the server goes on.
    with pytest.raises(aiohttp.ClientError):
        r = await client.get("/bad-header-stream")
        await r.read()
    assert (await client.get("/ok")).status == 200
