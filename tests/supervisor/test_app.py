"""The whole supervisor app (routes, middleware, runner) over HTTP against the fake
worker: fast checks of the paths that need a misbehaving worker."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from protocol import Cancel
from supervisor.app import create_app
from supervisor.config import Config
from supervisor.memory.probe import MemoryReading
from tests.supervisor.fakes import FakeBehaviour, FakeWorld


async def client_for(world: FakeWorld | None, *, probe=None, factory_for=None, **cfg) -> TestClient:
    cfg.setdefault("state_dir", Path(tempfile.mkdtemp(prefix="mlxd-app-")))
    cfg.setdefault("models", ("fake",))
    config = Config(**{"restart_backoff": 0.01, "shutdown_timeout": 2.0, **cfg})
    app = create_app(config, factory_for=factory_for or world.factory, probe=probe or plenty)
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    return client


def plenty() -> MemoryReading:
    return MemoryReading(64 << 30, 128 << 30, "normal", "test")


async def wait_health(client, predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        r = await client.get("/health")
        body = await r.json()
        if predicate(r.status, body):
            return r.status, body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.02)


async def test_health_is_503_while_loading_then_200():
    client = await client_for(FakeWorld(FakeBehaviour(load_s=0.3)))
    try:
        r = await client.get("/health")
        body = await r.json()
        assert r.status == 503 and body["workers"][0]["state"] in ("waiting", "starting")
        status, body = await wait_health(client, lambda s, b: s == 200)
        assert body["status"] == "ok" and body["workers"][0]["state"] == "ready"
    finally:
        await client.close()


async def test_crash_loop_makes_health_say_so_and_requests_503():
    client = await client_for(FakeWorld(FakeBehaviour(die_after_ready_s=0.0)),
                              crash_budget=2)
    try:
        status, body = await wait_health(
            client, lambda s, b: b["workers"][0]["state"] == "broken")
        assert status == 503 and "crash loop" in body["reason"]
        r = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "x"}]})
        assert r.status == 503
        err = (await r.json())["error"]
        assert "crash loop" in err["message"] and r.headers["Retry-After"]
    finally:
        await client.close()


async def test_client_disconnect_sends_cancel():
    world = FakeWorld(FakeBehaviour(tokens=10_000, step_s=0.005))
    client = await client_for(world)
    try:
        await wait_health(client, lambda s, b: s == 200)
        resp = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True})
        assert resp.status == 200
        await resp.content.readline()
        resp.close()  # the client leaves mid-stream
        deadline = time.monotonic() + 5
        while not any(isinstance(m, Cancel) for m in world.received):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        _, body = await wait_health(client, lambda s, b: b["workers"][0]["in_flight"] == 0)
        assert body["workers"][0]["restarts"] == 0
    finally:
        await client.close()


async def test_worker_crash_before_start_requeues_invisibly():
    # Epoch 1 dies while the request is running; a second request waiting behind it is
    # served by epoch 2 and its client never sees the crash.
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=1000, crash_after_tokens=3)},
                      behaviour=FakeBehaviour(tokens=2))
    client = await client_for(world)
    try:
        await wait_health(client, lambda s, b: s == 200)
        body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
        first, second = await asyncio.gather(client.post("/v1/chat/completions", json=body),
                                             client.post("/v1/chat/completions", json=body))
        statuses = sorted([first.status, second.status])
        assert statuses == [200, 503]
        ok = first if first.status == 200 else second
        assert (await ok.json())["choices"][0]["message"]["content"] == "w1 w2 "
    finally:
        await client.close()
