"""Issue "Nothing a client sends may take a model down", findings 5, 6b and 6c, with real
processes.

What a request may load: only models inside the model roots (here two `--models-dir`
roots, the state dir's `models/` and an empty HF cache), by real path, one worker per
directory whatever the spelling; everything else is the same 404, however the name is
made (absent, not a model, outside the roots, 5000 characters, NUL). A load on request
that fails leaves nothing behind. Garbled bytes in the admin Authorization header are a
401. After each, the server answers a normal request within seconds.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from tests.integration.conftest import assert_envelope
from tests.integration.test_faults import wait_for
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    """A server on `demo-random` whose roots are the tiny model's directory and `mine` (holding
    a model that cannot load), and a working copy of the tiny model outside every root."""
    base = tmp_path_factory.mktemp("load-rules")
    broken = base / "mine" / "broken"
    broken.mkdir(parents=True)
    shutil.copy(tiny_model / "config.json", broken)  # a config, no weights: the load fails
    outside = base / "outside"
    shutil.copytree(tiny_model, outside)
    (base / "state").mkdir()
    with ServerProcess(["demo-random"], "--models-dir", str(tiny_model.parent),
                       "--models-dir", str(base / "mine"), state_dir=base / "state") as srv:
        srv.wait_healthy(timeout=180)
        yield srv, {"base": base, "broken": broken, "outside": outside}


def chat(srv, model, timeout=60.0) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=timeout, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def workers(srv) -> dict[str, int]:
    _, body = srv.get("/health")
    return {w["model"]: w["pid"] for w in body["workers"]}


def serves(srv, model="demo-random") -> None:
    """The regression check after each finding: a normal request, answered."""
    r = chat(srv, model, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == model, r.text


def seen(response: httpx.Response, name: str) -> tuple:
    """What a client learns from an error, with the name it sent taken out."""
    error = assert_envelope(response, 404, "model_not_found", "model")
    return error["type"], error["message"].replace(name, "NAME")


def test_outside_the_roots_is_the_same_404_as_nothing_at_all(world, tiny_model):
    srv, paths = world
    before = workers(srv)
    names = [str(paths["outside"]),                      # a working model, outside the roots
             str(paths["base"] / "nowhere"),              # nothing there
             str(tiny_model.parent),                      # inside, a directory but no model
             f"{tiny_model.parent}/../{paths['base'].name}/outside"]  # escaping by `..`
    answers = {seen(chat(srv, name), name) for name in names}
    assert len(answers) == 1
    for name in names:  # asking about it is no probe either
        r = httpx.get(srv.url + "/v1/models/" + name.lstrip("/"), timeout=10)
        seen(r, name.lstrip("/"))
    assert workers(srv) == before  # nothing was spawned
    listed = {m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]}
    assert not listed & set(names)
    serves(srv)


def test_every_spelling_of_a_model_is_one_worker(world, tiny_model):
    srv, paths = world
    model = str(tiny_model)
    r = chat(srv, model)  # loads it on request: inside a --models-dir root
    assert r.status_code == 200 and r.json()["model"] == model, r.text
    loaded = workers(srv)
    link = paths["base"] / "link"
    link.symlink_to(tiny_model)
    for spelling in (f"{tiny_model.parent}/./{tiny_model.name}", model + "/", str(link),
                     f"{tiny_model.parent}/{tiny_model.name}/../{tiny_model.name}"):
        r = chat(srv, spelling, timeout=10)
        assert r.status_code == 200 and r.json()["model"] == model, r.text
    demo_dir = srv.state_dir / "models" / "demo-random"
    r = chat(srv, str(demo_dir), timeout=10)  # the demo by its path is the demo
    assert r.status_code == 200 and r.json()["model"] == "demo-random", r.text
    assert workers(srv) == loaded and set(loaded) >= {"demo-random", model}
    serves(srv, model)


def test_a_failed_load_on_request_leaves_nothing_behind(world):
    srv, paths = world
    broken = str(paths["broken"])
    r = chat(srv, broken)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_failed", r.text
    assert "load" in r.json()["error"]["message"]  # the client that asked learns why
    wait_for(lambda: broken not in workers(srv), 5)  # forgotten right after its error
    status, health = srv.get("/health")
    assert broken not in workers(srv) and status == 200, health
    assert all(w["state"] != "broken" for w in health["workers"])
    listed = {m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]}
    assert broken not in listed
    serves(srv)


@pytest.mark.parametrize("name,status", [
    ("a" * 5000, 404), ("/" + "b" * 300 + "/m", 404), ("/tmp/x\u0000y", 404),
    ("\ud800", 400),  # a lone surrogate: request validation refuses any such string first
])
def test_absurd_names_are_a_clean_4xx(world, name, status):
    srv, _ = world
    before = workers(srv)
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, timeout=10,
                   headers={"Content-Type": "application/json"})
    assert_envelope(r, status, "model_not_found" if status == 404 else None, "model")
    assert workers(srv) == before
    serves(srv)


def test_overlong_model_in_the_models_route_is_a_404(world):
    srv, _ = world
    r = httpx.get(srv.url + "/v1/models/" + "a" * 5000, timeout=10)
    assert_envelope(r, 404, "model_not_found")
    serves(srv)


@pytest.mark.parametrize("header", [b"Bearer \xff\xfe\xfd", b"Bearer \xc3\xa9t\xc3\xa9", b"\xe9 x"])
def test_garbled_admin_authorization_is_a_401(world, header):
    srv, _ = world

    async def send() -> bytes:  # raw bytes: no client library sends non-text headers
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /admin/status HTTP/1.1\r\nHost: localhost\r\nAuthorization: " + header
                     + b"\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
        writer.close()
        return raw

    head, _, body = asyncio.run(send()).partition(b"\r\n\r\n")
    assert head.split()[1] == b"401", head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    serves(srv)
