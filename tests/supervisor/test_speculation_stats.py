"""A worker's speculative decoding (Heartbeat.speculation) reaches /metrics, the admin
status `mlxctl status` and the dashboard read, and `mlxctl status`'s table."""

from __future__ import annotations

import asyncio

from mlxctl.format import format_status
from protocol.messages import SpeculationStats
from tests.supervisor.fakes import FakeBehaviour
from tests.supervisor.test_admin import admin_client
from tests.supervisor.test_app import wait_health
from tests.supervisor.test_pool import Worlds, model_dir


async def test_acceptance_and_tokens_per_verification_are_reported(tmp_path):
    a = model_dir(tmp_path, "a")
    stats = SpeculationStats(verifications=10, drafted=40, accepted=30)
    worlds = Worlds(FakeBehaviour(speculation=stats))
    client = await admin_client(tmp_path, worlds, [a])
    try:
        await wait_health(client, lambda s, body: s == 200)
        for _ in range(100):  # (until a heartbeat came)
            body = await (await client.get("/admin/status", headers=client.headers)).json()
            if body["workers"][0]["speculation"] is not None:
                break
            await asyncio.sleep(0.05)
        assert body["workers"][0]["speculation"] == {
            "verifications": 10, "drafted": 40, "accepted": 30, "acceptance": 0.75,
            "tokens_per_verification": 4.0}
        text = await (await client.get("/metrics")).text()
        for line in ("mlxd_speculative_verifications_total{model=\"%s\"} 10.0",
                     "mlxd_speculative_drafted_tokens_total{model=\"%s\"} 40.0",
                     "mlxd_speculative_accepted_tokens_total{model=\"%s\"} 30.0",
                     "mlxd_speculative_acceptance_ratio{model=\"%s\"} 0.75",
                     "mlxd_speculative_tokens_per_verification{model=\"%s\"} 4.0"):
            assert line % a in text, line
        def cell(body):
            lines = format_status(body).splitlines()
            head = next(i for i, line in enumerate(lines) if "DRAFTS OK" in line)
            return lines[head + 1][lines[head].index("DRAFTS OK, TOK/VERIFY"):]

        assert cell(body).startswith("75%, 4.00")
        body["workers"][0]["speculation"] = None  # (a worker that does not speculate)
        assert cell(body).startswith("- ")
    finally:
        await client.close()


def test_the_worker_heartbeats_its_batchs_figures_and_keeps_the_last():
    from worker.status import WorkerStatus

    status = WorkerStatus(epoch=1)
    stats = SpeculationStats(verifications=2, drafted=5, accepted=3)
    status.publish("busy", speculation=stats)
    status.publish("ready")  # (None: keep the last published figures)
    assert status.heartbeat().speculation == stats
