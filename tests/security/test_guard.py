"""The gate in front of the API (supervisor/http/guard.py), over HTTP against the fake
worker: API keys, the Host header (DNS rebinding), JSON content types (cross-site simple
POSTs), CORS, and what must not start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from protocol.settings import BY_NAME
from supervisor.config import Config
from supervisor.http import guard
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _envelope(resp, status: int, code: str | None = None) -> dict:
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


async def test_keys_guard_every_api_route_and_leave_health_open():
    client = await client_for(FakeWorld(FakeBehaviour()), api_key=("k-one", "k-two"))
    try:
        for path in ("/v1/models", "/v1/responses/resp_x"):
            err = await _envelope(await client.get(path), 401, "invalid_api_key")
            assert "Authorization: Bearer" in err["message"]
        await _envelope(await client.post("/tokenize", json={"model": "fake", "prompt": "x"}),
                        401)
        await _envelope(await client.post("/v1/chat/completions", json=CHAT), 401)
        bad = {"Authorization": "Bearer k-on"}
        await _envelope(await client.get("/v1/models", headers=bad), 401)
        await _envelope(await client.get("/v1/models", headers={"Authorization": "k-one"}), 401)
        # x-api-key is Anthropic's header: taken on its routes (Messages, and the Models API
        # on /v1/models that Anthropic clients list models with), not on OpenAI's.
        await _envelope(await client.post("/v1/chat/completions", json=CHAT,
                                          headers={"x-api-key": "k-one"}), 401)
        r = await client.get("/v1/models", headers={"x-api-key": "k-one"})
        assert r.status == 200
        await _envelope(await client.get("/v1/models", headers={"x-api-key": "wrong"}), 401)
        r = await client.post("/v1/messages", json={}, headers={"x-api-key": "k-one"})
        assert r.status != 401
        r = await client.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        body = await r.json()  # the 401 in the route's own (Anthropic's) envelope
        assert r.status == 401 and body["type"] == "error"
        assert body["error"]["type"] == "authentication_error" and "x-api-key" in \
            body["error"]["message"]
        for key in ("k-one", "k-two"):
            r = await client.post("/v1/chat/completions", json=CHAT,
                                  headers={"Authorization": f"Bearer {key}"})
            assert r.status == 200, await r.text()
        assert (await client.get("/health")).status in (200, 503)
        await _envelope(await client.get("/metrics"), 401)
        r = await client.get("/metrics", headers={"Authorization": "Bearer k-two"})
        assert r.status == 200 and "mlxd_" in await r.text()
    finally:
        await client.close()


async def test_public_metrics_and_no_keys_leave_the_api_open():
    client = await client_for(FakeWorld(FakeBehaviour()), api_key=("k",), public_metrics=True)
    try:
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()
    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        assert (await client.get("/v1/models")).status == 200
    finally:
        await client.close()


@pytest.mark.parametrize("host,ok", [
    ("localhost:8080", True), ("127.0.0.1:1", True), ("[::1]:8080", True), ("LOCALHOST", True),
    ("evil.example", False), ("evil.example:8080", False), ("127.0.0.1.evil.example", False),
    ("mybox.lan", True),  # named with --allowed-host
])
async def test_only_known_host_names_are_served(host, ok):
    client = await client_for(FakeWorld(FakeBehaviour()), allowed_hosts=("mybox.lan",))
    try:
        r = await client.get("/v1/models", headers={"Host": host})
        if ok:
            assert r.status == 200, await r.text()
        else:
            err = await _envelope(r, 403)
            assert "--allowed-host" in err["message"]
    finally:
        await client.close()


def test_a_wildcard_address_checks_only_the_names_given():
    assert guard.Guard(host="0.0.0.0").host_allowed("anything.lan")
    g = guard.Guard(host="0.0.0.0", allowed_hosts=("box.lan",))
    assert g.host_allowed("box.lan:8080") and g.host_allowed("localhost")
    assert not g.host_allowed("evil.example")
    assert guard.Guard(host="192.168.1.5").host_allowed("192.168.1.5:8080")


@pytest.mark.parametrize("content_type,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415), ("application/json", 200),
    ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
])
async def test_api_posts_need_a_json_content_type(content_type, status):
    import json

    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        r = await client.post("/v1/chat/completions", data=json.dumps(CHAT),
                              headers={"Content-Type": content_type})
        if status == 415:
            err = await _envelope(r, 415, "unsupported_media_type")
            assert "application/json" in err["message"]
        else:
            assert r.status == 200, await r.text()
    finally:
        await client.close()


async def test_a_post_without_a_body_needs_no_content_type():
    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        r = await client.post("/v1/responses/resp_missing/cancel",
                              skip_auto_headers=("Content-Type",))
        assert r.status == 404, await r.text()  # routed: not refused for its type
    finally:
        await client.close()


async def test_cors_is_off_unless_an_origin_is_named():
    origin = {"Origin": "http://localhost:3000"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        r = await client.get("/v1/models", headers=origin)
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        r = await client.options("/v1/chat/completions", headers=preflight)
        assert "Access-Control-Allow-Origin" not in r.headers
    finally:
        await client.close()
    client = await client_for(FakeWorld(FakeBehaviour()), cors_origins=("http://localhost:3000",))
    try:
        r = await client.options("/v1/chat/completions", headers=preflight)
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert "authorization" in r.headers["Access-Control-Allow-Headers"]
        r = await client.get("/v1/models", headers=origin)
        assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert r.headers["Vary"] == "Origin"
        r = await client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in r.headers
    finally:
        await client.close()


def test_key_files_must_be_private(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# mlxd keys\nalpha\n\n  beta  \n")
    os.chmod(path, 0o644)
    with pytest.raises(guard.KeyFileError, match="chmod 600"):
        guard.read_key_file(path)
    os.chmod(path, 0o600)
    assert guard.read_key_file(path) == ("alpha", "beta")
    with pytest.raises(guard.KeyFileError, match="cannot read"):
        guard.read_key_file(tmp_path / "missing")


def test_an_exposed_address_needs_a_key_or_an_explicit_no(tmp_path, caplog):
    with pytest.raises(guard.ExposedError, match="--insecure-no-auth"):
        guard.check_startup(Config(host="0.0.0.0", state_dir=tmp_path))
    assert guard.check_startup(Config(host="0.0.0.0", state_dir=tmp_path, api_key=("k",))).keys
    with caplog.at_level(logging.WARNING, logger="mlxd.guard"):
        guard.check_startup(Config(host="0.0.0.0", state_dir=tmp_path, insecure_no_auth=True))
    assert "WITHOUT API KEYS" in caplog.text
    guard.check_startup(Config(host="127.0.0.1", state_dir=tmp_path))  # loopback: fine


def test_keys_never_show_in_print_config(tmp_path):
    assert BY_NAME["api_key"].show(("sk-secret-1", "sk-secret-2")) == "(hidden: 2 set)"
    for fmt in ("table", "json"):
        out = subprocess.run(
            [sys.executable, "-m", "supervisor", "--print-config", fmt, "--model", "x",
             "--api-key", "sk-secret-1", "--state-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "MLXD_API_KEY": "sk-secret-2"})
        assert out.returncode == 0, out.stderr
        assert "sk-secret" not in out.stdout and "hidden" in out.stdout
