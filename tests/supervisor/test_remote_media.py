"""Remote images (supervisor/api/fields/remote_media.py, through fields/media.py's
`fetch_remote`): off by default, a 400 naming --allow-remote-media; on, fetched from
public addresses only (the policy checks every hop and every resolved address), within
the image byte limit (checked while the body streams), one time limit, 3 redirects, 2xx
image/* answers only. A real aiohttp server on 127.0.0.1 serves the images; the tests
that fetch from it open the policy for loopback, one proves the default refuses it."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.test_utils import TestClient, TestServer

from protocol import Generate
from supervisor.api.fields import media
from supervisor.api.chat.request import parse_chat_request
from supervisor.api.fields.remote_media import FETCHER, Fetcher, install, is_public
from supervisor.api.responses.request import parse_responses_request
from supervisor.config import Config
from supervisor.http.errors import APIError

PNG = b"\x89PNG\r\n\x1a\n remote cat"
PARAM = "messages[0].content[1].image_url.url"
LOOPBACK = ipaddress.ip_address("127.0.0.1")


def only_loopback(addr) -> bool:
    """The test policy: the local test server's address and nothing else."""
    return addr == LOOPBACK


class FakeDNS(AbstractResolver):
    """Names the tests make up: images.test is the test server, evil.test a private
    address."""
    NAMES = {"images.test": "127.0.0.1", "evil.test": "10.0.0.1", "meta.test": "169.254.169.254"}

    async def resolve(self, host, port=0, family=socket.AF_INET):
        if host not in self.NAMES:
            raise OSError(f"no such host {host}")
        return [{"hostname": host, "host": self.NAMES[host], "port": port,
                 "family": socket.AF_INET, "proto": 0, "flags": 0}]

    async def close(self):
        pass


async def _endless(request):
    resp = web.StreamResponse(headers={"Content-Type": "image/png"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for _ in range(10_000):  # far more than any limit: the reader must stop it
        await resp.write(b"x" * 1024)
        await asyncio.sleep(0.001)
    return resp


async def _declared_too_long(request):
    # Headers promise more than the limit, then nothing comes: only an up-front check
    # answers 413 (a reader waiting for the body would time out instead).
    resp = web.StreamResponse(headers={"Content-Type": "image/png",
                                       "Content-Length": str(10_000)})
    await resp.prepare(request)
    await asyncio.sleep(30)
    return resp


async def _slow_headers(request):
    await asyncio.sleep(30)
    return web.Response(body=PNG, content_type="image/png")


async def _slow_body(request):
    resp = web.StreamResponse(headers={"Content-Type": "image/png"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    await resp.write(b"\x89PNG")
    await asyncio.sleep(30)
    return resp


async def _redirects(request):
    n = int(request.match_info["n"])
    raise web.HTTPFound(f"/hops/{n - 1}" if n > 1 else "/cat.png")


@pytest.fixture
async def images():
    """A local image server: (its base URL on 127.0.0.1, the paths it was asked for)."""
    asked = []

    @web.middleware
    async def record(request, handler):
        asked.append(request.path_qs)
        return await handler(request)

    def serve(body, content_type="image/png"):
        async def handler(request):
            return web.Response(body=body, content_type=content_type)
        return handler

    app = web.Application(middlewares=[record])
    app.router.add_get("/cat.png", serve(PNG))
    app.router.add_get("/big.png", serve(b"x" * 2000))  # with its Content-Length
    app.router.add_get("/endless.png", _endless)
    app.router.add_get("/declared.png", _declared_too_long)
    app.router.add_get("/slow.png", _slow_headers)
    app.router.add_get("/slow-body.png", _slow_body)
    app.router.add_get("/page.html", serve(b"<html>", "text/html"))
    app.router.add_get("/empty.png", serve(b""))
    app.router.add_get("/hops/{n}", _redirects)
    for name, where in (("to-meta", "http://169.254.169.254/latest/meta-data/"),
                        ("to-private", "http://10.0.0.1/cat.png"),
                        ("to-evil", "http://evil.test/cat.png"),
                        ("to-ftp", "ftp://images.test/cat.png")):
        async def go(request, where=where):
            raise web.HTTPFound(where)
        app.router.add_get(f"/{name}", go)

    async def no_location(request):
        return web.Response(status=302)
    app.router.add_get("/no-location", no_location)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}", asked
    await server.close()


@pytest.fixture
async def fetcher():
    f = Fetcher(timeout=5.0, allow=only_loopback, resolver=FakeDNS())
    yield f
    await f.close()


def responses_gen(url: str) -> Generate:
    req = parse_responses_request({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "?"}, {"type": "input_image", "image_url": url}]}]})
    return req.to_generate(list(req.input_items), Config(), "resp_1")


def chat_gen(*urls) -> Generate:
    parts = [{"type": "text", "text": "?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    r = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": parts}]})
    return r.to_generate(Config())


async def fetched(fetcher, *urls) -> tuple:
    return (await media.fetch_remote(chat_gen(*urls), {FETCHER: fetcher})).images


async def refused(fetcher, url, status=400) -> APIError:
    with pytest.raises(APIError) as e:
        await fetched(fetcher, url)
    assert e.value.status == status, e.value.message
    assert e.value.param == PARAM
    return e.value


# ---- on: the worker-bound request carries the bytes ---------------------------------------

async def test_a_remote_image_travels_as_its_bytes_in_order(images, fetcher):
    base, asked = images
    inline = "data:image/png;base64,iVBORw0KGgo="
    gen = chat_gen(inline, f"{base}/cat.png?size=2", f"http://images.test:{base.rsplit(':', 1)[1]}/cat.png")
    assert gen.messages[0]["content"][1:] == [{"type": "image"}] * 3
    out = await media.fetch_remote(gen, {FETCHER: fetcher})
    assert out.images == (b"\x89PNG\r\n\x1a\n", PNG, PNG)
    assert out.messages == gen.messages and sorted(asked) == ["/cat.png", "/cat.png?size=2"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=Generate).images == out.images


async def test_a_responses_input_image_is_fetched_too(images, fetcher):
    base, _ = images
    gen = responses_gen(f"{base}/cat.png")
    assert (await media.fetch_remote(gen, {FETCHER: fetcher})).images == (PNG,)


async def test_a_request_without_remote_images_is_left_alone():
    gen = chat_gen("data:image/png;base64,iVBORw0KGgo=")
    assert await media.fetch_remote(gen, {}) is gen


# ---- off by default ------------------------------------------------------------------------

async def test_off_by_default_a_400_naming_the_flag(images):
    assert Config().allow_remote_media is False and Config().remote_media_timeout == 10.0
    base, asked = images
    app = web.Application()
    install(app, Config())
    assert FETCHER not in app
    for gen in (chat_gen(f"{base}/cat.png"), responses_gen(f"{base}/cat.png")):
        with pytest.raises(APIError) as e:
            await media.fetch_remote(gen, app)
        assert e.value.status == 400 and e.value.code == "invalid_image_url"
        assert "--allow-remote-media" in e.value.message
        assert e.value.param == PARAM or e.value.param.endswith(".content[1]"), e.value.param
    assert asked == []


async def test_install_makes_a_fetcher_with_the_timeout_and_closes_it_on_cleanup():
    app = web.Application()
    install(app, Config(allow_remote_media=True, remote_media_timeout=3.5))
    f = app[FETCHER]
    assert f.timeout == 3.5 and f.allow is is_public
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    session = f._open()
    await server.close()
    assert session.closed


# ---- addresses -----------------------------------------------------------------------------

@pytest.mark.parametrize("addr", [
    "10.0.0.1", "10.255.255.255", "172.16.0.1", "192.168.1.1", "127.0.0.1", "127.1.2.3",
    "169.254.169.254", "0.0.0.0", "100.64.0.1", "224.0.0.1", "240.0.0.1",
    "255.255.255.255", "192.0.2.1", "198.18.0.1",
    "::1", "::", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
    "fc00::1", "fd12:3456::1", "fe80::1", "ff02::1", "ff0e::1", "2001:db8::1",
    "2002:7f00:1::1",       # 6to4 around 127.0.0.1
    "2002:a00:1::1",        # 6to4 around 10.0.0.1
    "64:ff9b::a00:1",       # NAT64 around 10.0.0.1
    "64:ff9b::a9fe:a9fe",   # NAT64 around 169.254.169.254
])
def test_the_default_policy_refuses_private_and_local_addresses(addr):
    assert not is_public(ipaddress.ip_address(addr))


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "93.184.216.34",
                                  "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_the_default_policy_takes_public_addresses(addr):
    assert is_public(ipaddress.ip_address(addr))


async def test_loopback_is_refused_by_default(images, caplog):
    base, asked = images
    port = base.rsplit(":", 1)[1]
    f = Fetcher(timeout=5.0)  # the default policy, the real resolver
    try:
        for url in (f"{base}/cat.png", f"http://localhost:{port}/cat.png",
                    f"http://[::1]:{port}/cat.png", f"http://[::ffff:127.0.0.1]:{port}/cat.png",
                    f"http://0.0.0.0:{port}/cat.png"):
            e = await refused(f, url)
            assert "private or local address" in e.message
            assert "127.0.0.1" not in e.message and "::1" not in e.message
    finally:
        await f.close()
    assert asked == []  # never connected


async def test_a_name_resolving_to_a_refused_address_is_refused(images, fetcher):
    base, asked = images
    port = base.rsplit(":", 1)[1]
    for name in ("evil.test", "meta.test"):
        e = await refused(fetcher, f"http://{name}:{port}/cat.png")
        assert "private or local address" in e.message and "10.0.0.1" not in e.message


@pytest.mark.parametrize("path", ["to-meta", "to-private", "to-evil"])
async def test_a_redirect_to_a_refused_address_is_refused(images, fetcher, path):
    base, asked = images
    e = await refused(fetcher, f"{base}/{path}")
    assert "private or local address" in e.message
    assert asked == [f"/{path}"]


async def test_only_http_and_https(images, fetcher):
    base, _ = images
    assert "only http and https" in (await refused(fetcher, f"{base}/to-ftp")).message
    with pytest.raises(APIError) as e:  # not even parsed as an image URL
        chat_gen("ftp://example.com/cat.png")
    assert e.value.status == 400


# ---- redirects, answers --------------------------------------------------------------------

async def test_three_redirects_are_followed_and_a_fourth_is_refused(images, fetcher):
    base, asked = images
    assert await fetched(fetcher, f"{base}/hops/3") == (PNG,)
    assert asked == ["/hops/3", "/hops/2", "/hops/1", "/cat.png"]
    asked.clear()
    e = await refused(fetcher, f"{base}/hops/4")
    assert "redirects more than 3 times" in e.message and e.code == "image_fetch_failed"
    assert asked == ["/hops/4", "/hops/3", "/hops/2", "/hops/1"]
    assert "without a Location" in (await refused(fetcher, f"{base}/no-location")).message


async def test_a_404_is_a_400_naming_it(images, fetcher):
    base, _ = images
    e = await refused(fetcher, f"{base}/missing.png")
    assert "404" in e.message and e.code == "image_fetch_failed"


async def test_a_content_type_other_than_an_image_is_a_400(images, fetcher):
    base, _ = images
    e = await refused(fetcher, f"{base}/page.html")
    assert "not an image" in e.message and "text/html" in e.message
    assert "empty" in (await refused(fetcher, f"{base}/empty.png")).message


async def test_a_server_that_is_not_there_is_a_400(fetcher):
    e = await refused(fetcher, "http://images.test:1/cat.png")  # nothing listens on port 1
    assert e.code == "image_fetch_failed" and "could not be fetched" in e.message


# ---- limits --------------------------------------------------------------------------------

async def test_an_image_over_the_limit_is_a_413_with_or_without_content_length(
        images, fetcher, monkeypatch):
    base, _ = images
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 1000)
    for path in ("big.png",        # Content-Length: 2000
                 "declared.png",   # Content-Length: 10000, then no body at all
                 "endless.png"):   # chunked, no end: stopped once over the limit
        t0 = time.monotonic()
        e = await refused(fetcher, f"{base}/{path}", status=413)
        assert e.code == "image_too_large" and "1000 bytes" in e.message
        assert time.monotonic() - t0 < 3, path
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", len(PNG))
    assert await fetched(fetcher, f"{base}/cat.png") == (PNG,)  # exactly the limit


@pytest.mark.parametrize("path", ["slow.png", "slow-body.png"])
async def test_a_slow_server_is_a_400_after_the_time_limit(images, path):
    base, _ = images
    f = Fetcher(timeout=0.3, allow=only_loopback)
    t0 = time.monotonic()
    try:
        e = await refused(f, f"{base}/{path}")
    finally:
        await f.close()
    assert time.monotonic() - t0 < 2
    assert "could not be fetched in 0.3 s" in e.message and e.code == "image_fetch_failed"


async def test_the_first_failure_ends_the_other_fetches(images, fetcher):
    base, _ = images
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        await fetched(fetcher, f"{base}/slow.png", f"{base}/missing.png")
    assert "404" in e.value.message and time.monotonic() - t0 < 2


async def test_logs_name_the_host_and_never_the_path_or_query(images, fetcher, caplog):
    base, _ = images
    caplog.set_level(logging.DEBUG, logger="mlxd.media")
    await fetched(fetcher, f"{base}/cat.png?token=SECRET1")
    with pytest.raises(APIError):
        await fetched(fetcher, f"{base}/missing.png?token=SECRET2")
    with pytest.raises(APIError):
        await fetched(fetcher, "http://evil.test/x.png?token=SECRET3")
    assert "127.0.0.1" in caplog.text and "evil.test" in caplog.text
    assert "SECRET" not in caplog.text and "cat.png" not in caplog.text


# ---- through the app (fake workers): what the worker is sent -----------------------------

async def test_the_app_fetches_for_chat_and_responses_and_the_worker_gets_bytes(images):
    from supervisor.app import create_app
    from tests.supervisor.fakes import FakeWorld
    from tests.supervisor.test_app import plenty

    base, _ = images
    world = FakeWorld()
    config = Config(models=("fake",), state_dir=Path(tempfile.mkdtemp(prefix="mlxd-rm-")),
                    restart_backoff=0.01, shutdown_timeout=2.0, allow_remote_media=True)
    app = create_app(config, factory_for=world.factory, probe=plenty)
    assert isinstance(app[FETCHER], Fetcher) and app[FETCHER].allow is is_public
    app[FETCHER] = Fetcher(timeout=5.0, allow=only_loopback)  # the test server's address
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        r = await client.post("/v1/chat/completions", json={"model": "fake", "max_tokens": 2,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "?"},
                {"type": "image_url", "image_url": {"url": f"{base}/cat.png"}}]}]})
        assert r.status == 200, await r.text()
        r = await client.post("/v1/responses", json={"model": "fake", "max_output_tokens": 2,
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": f"{base}/cat.png"}]}]})
        assert r.status == 200, await r.text()
        sent = [m for m in world.received if isinstance(m, Generate)]
        assert [m.images for m in sent] == [(PNG,), (PNG,)]
        r = await client.post("/v1/chat/completions", json={"model": "fake", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": f"{base}/missing.png"}}]}]})
        body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "image_fetch_failed"
        assert body["error"]["param"] == "messages[0].content[0].image_url.url"
    finally:
        await client.close()
    assert app[FETCHER]._session is None  # closed on cleanup
