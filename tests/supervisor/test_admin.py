"""The admin API, /metrics, /v1/models and shutdown over HTTP, against the fake worker."""

from __future__ import annotations

import asyncio
import os
import stat
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from supervisor.admin.routes import ADMIN, AdminState, check_admin, same_token
from supervisor.admin.token import ensure_token, read_token, token_path
from supervisor.http.errors import APIError
from tests.supervisor.fakes import FakeBehaviour
from tests.supervisor.test_app import client_for, wait_health
from tests.supervisor.test_pool import Worlds, model_dir


async def admin_client(tmp_path, worlds: Worlds, models=(), **cfg):
    cfg.setdefault("models_dirs", (tmp_path,))  # requests may load what model_dir makes
    client = await client_for(None, models=tuple(models), state_dir=tmp_path,
                              factory_for=worlds.factory_for, **cfg)
    token = read_token(tmp_path)
    client.headers = {"Authorization": f"Bearer {token}"}
    return client


def test_token_is_created_once_with_mode_0600(tmp_path):
    token = ensure_token(tmp_path)
    assert len(token) >= 32 and read_token(tmp_path) == token
    assert stat.S_IMODE(token_path(tmp_path).stat().st_mode) == 0o600
    os.chmod(token_path(tmp_path), 0o644)
    assert ensure_token(tmp_path) == token  # kept, and its mode tightened
    assert stat.S_IMODE(token_path(tmp_path).stat().st_mode) == 0o600


@pytest.mark.parametrize("peer,header,status", [
    ("10.1.2.3", "Bearer right", 403),     # another machine: refused even with the token
    ("192.168.1.9", "", 403),
    ("127.0.0.1", "", 401),
    ("127.0.0.1", "Bearer wrong", 401),
    ("127.0.0.1", "Basic right", 401),
    ("::1", "Bearer right", None),
    ("127.0.0.1", "bearer right", None),
    ("127.0.0.1", "Bearer d\u00e9j\u00e0", 401),   # valid UTF-8, not ASCII
])
def test_admin_check(peer, header, status):
    app = web.Application()
    app[ADMIN] = AdminState(token="right")
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda k, d=None: (peer, 5555) if k == "peername" else d
    req = make_mocked_request("GET", "/admin/status", headers={"Authorization": header} if header else {},
                              app=app, transport=transport)
    if status is None:
        check_admin(req)
        return
    with pytest.raises(APIError) as err:
        check_admin(req)
    assert err.value.status == status


async def test_admin_routes_refuse_without_the_token_and_leave_the_api_open(tmp_path):
    worlds = Worlds(FakeBehaviour(tokens=2))
    client = await admin_client(tmp_path, worlds, [model_dir(tmp_path, "a")])
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await client.get("/admin/status", headers=headers)
            body = await r.json()
            assert r.status == 401 and body["error"]["code"] == "invalid_api_key"
            r = await client.post("/admin/kill", json={}, headers=headers)
            assert r.status == 401
        assert (await client.get("/health", headers={})).status in (200, 503)
    finally:
        await client.close()


async def test_status_reports_workers_memory_and_server(tmp_path):
    a = model_dir(tmp_path, "a")
    client = await admin_client(tmp_path, Worlds(FakeBehaviour(tokens=3)), [a])
    try:
        await wait_health(client, lambda s, b: s == 200)
        r = await client.post("/v1/completions", json={"model": "a", "prompt": "hi"})
        assert r.status == 200
        body = await (await client.get("/admin/status", headers=client.headers)).json()
        assert body["status"] == "ok" and body["server"]["pid"] == os.getpid()
        assert body["memory"]["available_bytes"] == 64 << 30  # the injected reading
        (w,) = body["workers"]
        assert w["model"] == a and w["state"] == "ready" and w["pinned"]
        assert w["tokens_per_s"] > 0 and w["queued"] == 0 and w["slots"] >= 1
        assert body["server"]["log_file"].endswith("mlxd.log")
    finally:
        await client.close()


async def test_swap_load_unload_kill_over_http(tmp_path):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    worlds = Worlds(FakeBehaviour(tokens=2))
    client = await admin_client(tmp_path, worlds, [a])
    h = client.headers
    try:
        await wait_health(client, lambda s, body: s == 200)
        r = await client.post("/admin/swap", json={"model": b, "mode": "force"}, headers=h)
        body = await r.json()
        assert r.status == 200 and body["model"] == b and body["replaced"] == [a]
        r = await client.post("/admin/load", json={"model": a}, headers=h)
        assert r.status == 200 and (await r.json())["state"] == "ready"
        _, health = await wait_health(client, lambda s, body: len(body["workers"]) == 2)
        r = await client.post("/admin/kill", json={"model": "b"}, headers=h)
        killed = (await r.json())["killed"]
        assert killed == [{"model": b, "cancelled": 0, "restarted": True}]
        r = await client.post("/admin/unload", json={"model": a}, headers=h)
        assert r.status == 200
        r = await client.post("/admin/unload", json={"model": a}, headers=h)
        assert r.status == 404
        r = await client.post("/admin/swap", json={"model": b, "mode": "gently"}, headers=h)
        assert r.status == 400 and (await r.json())["error"]["param"] == "mode"
        r = await client.post("/admin/load", json={"model": str(tmp_path / "nope")}, headers=h)
        assert r.status == 404
        metrics = await (await client.get("/metrics")).text()
        assert 'mlxd_swaps_total{mode="force",outcome="ok"} 1.0' in metrics
        assert f'mlxd_worker_restarts_total{{cause="admin",model="{b}"}} 1.0' in metrics
        assert 'mlxd_model_unloads_total{reason="swap"} 1.0' in metrics
        assert 'mlxd_model_unloads_total{reason="admin"} 1.0' in metrics
    finally:
        await client.close()


async def test_load_refused_by_the_gate_is_507_over_http(tmp_path):
    from tests.supervisor.test_pool import GiB, Memory
    big = model_dir(tmp_path, "big", weights=40 * GiB)
    memory = Memory(capacity=16 * GiB)
    client = await admin_client(tmp_path, Worlds(), [], probe=memory, memory_wait=0.2,
                                memory_factor=1.25, kv_budget=2 * GiB)  # need: 52 GiB
    memory.available = 16 * GiB
    try:
        r = await client.post("/admin/load", json={"model": big}, headers=client.headers)
        err = (await r.json())["error"]
        assert r.status == 507 and err["code"] == "insufficient_memory"
        assert "52.0 GiB" in err["message"] and "16.0 GiB is available" in err["message"]
        r = await client.post("/v1/chat/completions", json={
            "model": big, "messages": [{"role": "user", "content": "x"}]})
        assert r.status == 507  # load on request: the same refusal, in the envelope
        metrics = await (await client.get("/metrics")).text()
        assert f'mlxd_model_load_refusals_total{{model="{big}"}} 2.0' in metrics
    finally:
        await client.close()


async def test_metrics_count_requests_tokens_and_latencies(tmp_path):
    a = model_dir(tmp_path, "a")
    client = await admin_client(tmp_path, Worlds(FakeBehaviour(tokens=4, step_s=0.01)), [a])
    try:
        await wait_health(client, lambda s, b: s == 200)
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json={
                "model": "a", "messages": [{"role": "user", "content": "hey"}]})
            assert r.status == 200
        assert (await client.get("/v1/nope")).status == 404
        await asyncio.sleep(0.25)  # two loop-lag samples at least
        r = await client.get("/metrics")
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
        ep = 'endpoint="/v1/chat/completions",method="POST",status="200"'
        assert f"mlxd_requests_total{{{ep}}} 2.0" in text
        assert 'endpoint="unmatched",method="GET",status="404"' in text
        assert f'mlxd_generation_tokens_total{{model="{a}"}} 8.0' in text
        assert f'mlxd_prompt_tokens_total{{model="{a}"}} 6.0' in text
        assert f'mlxd_time_to_first_token_seconds_count{{model="{a}"}} 2.0' in text
        assert f'mlxd_inter_token_latency_seconds_count{{model="{a}"}} 2.0' in text
        for gauge in ("mlxd_queue_depth", "mlxd_in_flight", "mlxd_memory_available_bytes",
                      'mlxd_worker_memory_bytes{kind="mlx_active"'):
            assert gauge in text
        # The loop-lag sampler runs every 0.1 s from startup: samples accumulate.
        lag = [line for line in text.splitlines()
               if line.startswith("mlxd_event_loop_lag_seconds_count")]
        assert lag and float(lag[0].split()[-1]) >= 1
    finally:
        await client.close()


async def test_models_lists_loaded_and_local_and_get_never_loads(tmp_path):
    a = model_dir(tmp_path, "a")
    demo = tmp_path / "models" / "demo"  # a built demo model counts as local
    model_dir(tmp_path / "models", "demo")
    client = await admin_client(tmp_path, Worlds(), [a])
    try:
        await wait_health(client, lambda s, b: s == 200)
        data = (await (await client.get("/v1/models")).json())["data"]
        by_id = {m["id"]: m for m in data}
        assert by_id[a]["state"] == "ready" and by_id[a]["context_length"] == 128
        assert by_id["demo"]["state"] == "not_loaded" and by_id["demo"]["size_bytes"] > 0
        r = await client.get("/v1/models/demo")
        assert r.status == 200 and (await r.json())["state"] == "not_loaded"
        assert (await client.get("/v1/models/nothing-here")).status == 404
        _, health = await wait_health(client, lambda s, b: True)
        assert [w["model"] for w in health["workers"]] == [a]  # asking loaded nothing
        models = (await (await client.get("/admin/models", headers=client.headers)).json())["models"]
        assert {m["id"]: m["state"] for m in models} == {a: "ready", "demo": "not_loaded"}
        assert str(demo) in [m["path"] for m in models]
    finally:
        await client.close()


async def test_shutdown_drains_running_requests_before_cancelling(tmp_path):
    a = model_dir(tmp_path, "a")
    client = await admin_client(tmp_path, Worlds(FakeBehaviour(tokens=40, step_s=0.01)), [a],
                                shutdown_timeout=5.0)
    await wait_health(client, lambda s, b: s == 200)
    request = asyncio.ensure_future(client.post("/v1/chat/completions", json={
        "model": "a", "messages": [{"role": "user", "content": "x"}]}))
    await wait_health(client, lambda s, b: b["workers"][0]["in_flight"] == 1)
    # What SIGTERM does once aiohttp has stopped listening: the app's on_shutdown.
    shutdown = asyncio.ensure_future(client.server.runner.shutdown())
    await asyncio.sleep(0.05)
    late = await client.post("/v1/completions", json={"model": "a", "prompt": "x"})
    assert late.status == 503 and "shutting down" in (await late.json())["error"]["message"]
    r = await request
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 40
    await shutdown
    await client.close()


@pytest.mark.parametrize("given", ["\udcff\udcfe", "right\udce9", "\ud800", "r\u00e9ght", "righ"])
def test_a_token_that_is_no_text_is_just_wrong(given):
    # aiohttp hands header bytes that are not UTF-8 over as lone surrogates.
    assert same_token("right", "right") and not same_token(given, "right")


async def raw_get(client, path: str, header: bytes) -> tuple[int, bytes]:
    """GET with an Authorization header of exactly these bytes (no client library lets
    one send bytes that are not text): the status and the body."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: localhost\r\nAuthorization: " + header
                 + b"\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("header", [b"Bearer \xff\xfe", b"Bearer \xc3\xa9", b"\xe9\xe9 token"])
async def test_garbled_authorization_bytes_are_a_401_in_the_envelope(tmp_path, header):
    import json

    client = await admin_client(tmp_path, Worlds(), [model_dir(tmp_path, "a")])
    try:
        status, body = await raw_get(client, "/admin/status", header)
        error = json.loads(body)["error"]
        assert status == 401 and error["code"] == "invalid_api_key"
        assert set(error) == {"message", "type", "param", "code"}
        r = await client.get("/admin/status", headers=client.headers)  # the right token still works
        assert r.status == 200
    finally:
        await client.close()


async def test_model_lookup_does_not_probe_the_disk_and_admin_sees_why(tmp_path):
    from tests.supervisor.test_pool_routing import shape

    outside = model_dir(tmp_path / "outside", "m")
    absent = str(tmp_path / "outside" / "nope")
    client = await admin_client(tmp_path, Worlds(), [], models_dirs=(tmp_path / "root",))
    try:
        errors = {}
        for name in (outside, absent, "a" * 5000, "/" + "b" * 300):
            r = await client.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "x"}]})
            body = await r.json()
            errors[name] = (r.status, body["error"]["type"], body["error"]["param"],
                            body["error"]["code"], body["error"]["message"].replace(
                                name if len(name) <= 256 else name[:256] + "…", "NAME"))
            r = await client.get("/v1/models/" + name)  # asking is no probe either
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        assert len(set(errors.values())) == 1 and errors[outside][0] == 404
        _, health = await wait_health(client, lambda s, b: True)
        assert health["workers"] == []
        status = await (await client.get("/admin/status", headers=client.headers)).json()
        assert str(tmp_path / "root") in status["limits"]["model_roots"]
        reasons = [r["reason"] for r in status["rejected_loads"]]
        assert reasons[0] == f"{outside} is outside the model roots" and len(reasons) == 4
        assert shape(APIError.model_not_found(outside), outside) == errors[outside]
    finally:
        await client.close()
