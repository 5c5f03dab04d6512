"""Every domain error raised before a request starts reaches the client through the one
map (supervisor/http/errors.py `api_error`) on every surface, in that surface's envelope.

An outside tester found Responses answering 500 where chat and Messages answered 503 for
the same queue timeout: its own wait-for-start path read `.param` off an Overloaded error.
A background response took the same path and stayed `queued` forever. So each error type
is raised at the one place every surface waits (`RequestHandle.started`) and each surface
is asked, over HTTP, against the whole app and the fake worker.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol import ModelKind
from supervisor.http.errors import api_error
from supervisor.workers.handle import RequestHandle
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for
from tests.supervisor.test_domain_errors import CASES

ERRORS = [c[0] for c in CASES]
MSG = [{"role": "user", "content": "hi"}]

# (route, body, the surface's envelope: "openai" or "anthropic"), one per surface and mode.
TEXT_SURFACES = [
    ("/v1/chat/completions", {"model": "fake", "messages": MSG}, "openai"),
    ("/v1/chat/completions", {"model": "fake", "messages": MSG, "stream": True}, "openai"),
    ("/v1/completions", {"model": "fake", "prompt": "hi"}, "openai"),
    ("/v1/completions", {"model": "fake", "prompt": "hi", "stream": True}, "openai"),
    ("/v1/responses", {"model": "fake", "input": "hi"}, "openai"),
    ("/v1/responses", {"model": "fake", "input": "hi", "stream": True}, "openai"),
    ("/v1/messages", {"model": "fake", "max_tokens": 8, "messages": MSG}, "anthropic"),
    ("/v1/messages", {"model": "fake", "max_tokens": 8, "messages": MSG, "stream": True},
     "anthropic"),
    ("/tokenize", {"model": "fake", "prompt": "hi"}, "openai"),
]
POOLING_SURFACES = [
    (ModelKind.EMBED, "/v1/embeddings", {"model": "fake", "input": "hi"}),
    (ModelKind.RERANK, "/v1/rerank", {"model": "fake", "query": "q", "documents": ["d"]}),
]


@pytest.fixture
def raise_before_start(monkeypatch):
    """Make every request's wait for its start raise `error` (set by the test)."""
    box = {}

    async def started(self, timeout):
        self.cancel()
        raise box["error"]

    monkeypatch.setattr(RequestHandle, "started", started)
    return box


def assert_envelope(status: int, body: dict, error, envelope: str) -> None:
    expected = api_error(error)
    assert status == expected.status, (type(error).__name__, body)
    if envelope == "anthropic":
        assert body["type"] == "error" and body["error"]["message"] == expected.message
    else:
        assert body["error"]["message"] == expected.message
        assert body["error"]["code"] == expected.code


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
async def test_each_error_before_start_has_its_status_on_every_surface(error,
                                                                       raise_before_start):
    raise_before_start["error"] = error
    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        for route, body, envelope in TEXT_SURFACES:
            r = await client.post(route, json=body)
            assert_envelope(r.status, await r.json(), error, envelope)
    finally:
        await client.close()


@pytest.mark.parametrize("kind,route,body", POOLING_SURFACES, ids=[s[1] for s in POOLING_SURFACES])
async def test_pooling_surfaces_map_errors_before_start_the_same_way(kind, route, body,
                                                                     raise_before_start):
    client = await client_for(FakeWorld(FakeBehaviour(model_kind=kind)))
    try:
        for error in ERRORS:
            raise_before_start["error"] = error
            r = await client.post(route, json=body)
            assert_envelope(r.status, await r.json(), error, "openai")
    finally:
        await client.close()


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
async def test_a_background_response_that_fails_before_start_ends_failed(error,
                                                                        raise_before_start):
    """Answered at once as `queued`; the error, whatever its type, ends it `failed` with
    the reason (never `queued` forever)."""
    raise_before_start["error"] = error
    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        r = await client.post("/v1/responses", json={"model": "fake", "input": "hi",
                                                     "background": True})
        assert r.status == 200
        rid = (await r.json())["id"]
        deadline = time.monotonic() + 5
        while True:
            got = await (await client.get(f"/v1/responses/{rid}")).json()
            if got["status"] not in ("queued", "in_progress"):
                break
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.02)
        assert got["status"] == "failed"
        assert got["error"]["message"] == api_error(error).message
        own = api_error(error).status < 500
        assert got["error"]["code"] == ("invalid_prompt" if own else "server_error")
    finally:
        await client.close()


async def test_a_background_response_whose_start_hits_a_bug_still_ends_failed(
        raise_before_start):
    raise_before_start["error"] = AttributeError("a bug")
    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        r = await client.post("/v1/responses", json={"model": "fake", "input": "hi",
                                                     "background": True})
        rid = (await r.json())["id"]
        deadline = time.monotonic() + 5
        while (got := await (await client.get(f"/v1/responses/{rid}")).json())["status"] \
                in ("queued", "in_progress"):
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.02)
        assert got["status"] == "failed" and got["error"]["code"] == "server_error"
    finally:
        await client.close()


async def test_a_background_response_its_client_cancels_while_queued_ends_cancelled():
    """The other side of the rule above: a cancel the client asked for is `cancelled`."""
    client = await client_for(FakeWorld(FakeBehaviour(tokens=1000, step_s=0.01)))
    try:
        busy = await client.post("/v1/responses", json={"model": "fake", "input": "a",
                                                        "background": True})
        queued = await client.post("/v1/responses", json={"model": "fake", "input": "b",
                                                          "background": True})
        rid = (await queued.json())["id"]
        got = await (await client.post(f"/v1/responses/{rid}/cancel", json={})).json()
        assert got["status"] == "cancelled" and got.get("error") is None
        await client.post(f"/v1/responses/{(await busy.json())['id']}/cancel", json={})
    finally:
        await client.close()


async def test_cancel_answers_even_when_the_run_outlasts_its_wait(monkeypatch):
    """A worker slow to honour the cancel (it is killed only after --cancel-grace) must
    not turn POST .../cancel into a 500: it answers with the response as it stands."""
    from supervisor.api.responses import routes

    monkeypatch.setattr(routes, "CANCEL_WAIT_S", 0.2)
    client = await client_for(FakeWorld(FakeBehaviour(tokens=200, ignore_cancel=True)),
                              cancel_grace=30)
    try:
        r = await client.post("/v1/responses", json={"model": "fake", "input": "a",
                                                     "background": True})
        rid = (await r.json())["id"]
        deadline = time.monotonic() + 5
        while (await (await client.get(f"/v1/responses/{rid}")).json())["status"] == "queued":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        r = await client.post(f"/v1/responses/{rid}/cancel", json={})
        assert r.status == 200 and (await r.json())["status"] == "in_progress"
    finally:
        await client.close()
