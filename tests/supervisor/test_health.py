"""GET /health in each state the pool reports, status code and body: the pool says what
its state is and why (HealthReport), and only supervisor/api/health.py makes that HTTP.
test_app.py covers loading (503) and ready (200 ok), test_pool.py the report itself."""

from __future__ import annotations

from supervisor.api.health import STORE_DOWN
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_admin import admin_client
from tests.supervisor.test_app import wait_health
from tests.supervisor.test_pool import Worlds, model_dir


def without_workers(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "workers"}


async def test_no_model_is_idle_with_load_on_request_and_unavailable_without(tmp_path):
    for allow, status, body in [
            (True, 200, {"status": "idle", "store": "ok",
                         "reason": "no model loaded; models load on request"}),
            (False, 503, {"status": "unavailable", "store": "ok",
                          "reason": "no model loaded"})]:
        state_dir = tmp_path / str(allow)
        state_dir.mkdir()
        client = await admin_client(state_dir, Worlds(), allow_load_on_request=allow)
        try:
            r = await client.get("/health")
            got = await r.json()
            assert (r.status, without_workers(got), got["workers"]) == (status, body, [])
        finally:
            await client.close()


async def test_one_model_broken_beside_a_ready_one_is_degraded_and_200(tmp_path):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    worlds = Worlds()
    worlds.by_model[b] = FakeWorld(FakeBehaviour(load_error="bad weights"))
    client = await admin_client(tmp_path, worlds, [a, b])
    try:
        status, body = await wait_health(client, lambda s, b: sorted(
            w["state"] for w in b["workers"]) == ["broken", "ready"])
        assert (status, without_workers(body)) == (
            200, {"status": "degraded", "reason": f"{b}: broken", "store": "ok"})
    finally:
        await client.close()


async def test_a_store_that_is_down_makes_an_ok_server_degraded_still_200(tmp_path):
    (tmp_path / "responses.db").mkdir()  # not a database: the store cannot open
    client = await admin_client(tmp_path, Worlds(), [model_dir(tmp_path, "a")])
    try:
        status, body = await wait_health(
            client, lambda s, b: [w["state"] for w in b["workers"]] == ["ready"])
        assert (status, without_workers(body)) == (
            200, {"status": "degraded", "reason": STORE_DOWN, "store": "unavailable"})
        # /admin/status says the pool's own view, the store apart.
        r = await client.get("/admin/status", headers=client.headers)
        assert (await r.json())["status"] == "ok"
    finally:
        await client.close()
