"""Every route of the app's route table but the public ones refuses a request without a key
once API keys are set (supervisor/http/guard.py): the API routes theirs, `/admin/*` its
own token. The walk reads the table `create_app` builds, so a route added later is covered
without being named here; only the public ones are named, and each must stay public."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import pytest

from supervisor.app import create_app
from supervisor.config import Config
from tests.serverproc import ServerProcess
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for

KEY = "sk-test-key"
# Open with keys set: health for probes, the web UI's pages (the page asks for the key).
PUBLIC = frozenset({"/health", "/", "/ui", "/ui/", "/ui/chat", "/ui/static/{name}"})
SAMPLE = {"model": "x", "id": "resp_x", "name": "x", "item_id": "msg_x"}  # values for the path's variables


def route_table(app=None, **cfg) -> list[tuple[str, str, bool]]:
    """(method, a concrete path, public) for every route of `app`, or of the app these
    settings make."""
    if app is None:
        cfg.setdefault("state_dir", Path(tempfile.mkdtemp(prefix="mlxd-routes-")))
        app = create_app(Config(api_key=(KEY,), **cfg), factory_for=FakeWorld().factory)
    out = []
    for route in app.router.routes():
        template = route.resource.canonical
        path = template
        for name, value in SAMPLE.items():
            path = path.replace("{" + name + "}", value)
        assert "{" not in path, f"no sample value for a variable of {template}"
        out.append((route.method, path, template in PUBLIC))
    return out


def test_the_table_has_the_routes_this_test_is_about():
    table = route_table()
    assert {"/detokenize", "/tokenize", "/rerank", "/reranking", "/v1/rerank",
            "/v1/messages", "/metrics", "/admin/status"} <= {p for _, p, _ in table}
    assert {p for _, p, public in table if public} == {*PUBLIC - {"/ui/static/{name}"},
                                                       "/ui/static/x"}


def _refused(method: str, path: str, status: int, body: bytes) -> None:
    assert status == 401, f"{method} {path} answered {status} without a key: {body[:200]!r}"
    if method != "HEAD":
        assert b"API key" in body or b"admin token" in body, (method, path, body)


async def test_every_route_but_the_public_ones_refuses_a_missing_key():
    client = await client_for(FakeWorld(FakeBehaviour(tokens=1)), api_key=(KEY,))
    try:
        for method, path, public in route_table(client.app):
            r = await client.request(method, path, json={} if method == "POST" else None)
            body = await r.read()
            if public:
                assert r.status != 401, (method, path)
                continue
            _refused(method, path, r.status, body)
            # A wrong key is no key; the right one passes the guard (admin has its own).
            r = await client.request(method, path, json={} if method == "POST" else None,
                                     headers={"Authorization": "Bearer sk-nope"})
            _refused(method, path, r.status, await r.read())
            if not path.startswith("/admin/"):
                r = await client.request(method, path, json={} if method == "POST" else None,
                                         headers={"Authorization": f"Bearer {KEY}"})
                assert r.status != 401, (method, path, await r.text())
    finally:
        await client.close()


def _until_listening(http: httpx.Client, srv: ServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert srv.proc.poll() is None, srv.log()
        try:
            http.get("/health")
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.1)


@pytest.mark.integration
def test_a_real_mlxd_refuses_every_route_of_its_table_without_a_key(tmp_path, tiny_model):
    """The same walk against a real mlxd, as soon as it listens (the guard answers before
    any worker would: its model may still be loading)."""
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    (tmp_path / "state").mkdir()
    with ServerProcess([str(tiny_model)], "--api-key-file", str(keys), state_dir=tmp_path / "state") as srv:
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            _until_listening(http, srv)
            for method, path, public in route_table(state_dir=tmp_path / "table"):
                r = http.request(method, path, json={} if method == "POST" else None)
                if public:
                    assert r.status_code != 401, (method, path)
                else:
                    _refused(method, path, r.status_code, r.content)
