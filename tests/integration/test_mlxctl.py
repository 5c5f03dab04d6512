"""mlxctl against a live server (text and --json), and the admin API's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.integration.conftest import assert_envelope
from tests.integration.test_faults import wait_for
from tests.serverproc import REPO, ServerProcess, free_port


def mlxctl(srv_or_url, *args, state_dir=None, timeout=120):
    url = srv_or_url if isinstance(srv_or_url, str) else srv_or_url.url
    state = state_dir if state_dir is not None else getattr(srv_or_url, "state_dir", None)
    argv = [sys.executable, "-m", "mlxctl.client", "--url", url]
    if state is not None:
        argv += ["--state-dir", str(state)]
    return subprocess.run([*argv, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def ok(out) -> subprocess.CompletedProcess:
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out


def test_status_text_and_json(server, model_id):
    out = ok(mlxctl(server, "status"))
    lines = out.stdout.splitlines()
    assert lines[0] == "status: ok"
    assert any(l.startswith("memory: ") and "available of" in l for l in lines)
    header = next(l for l in lines if l.startswith("MODEL"))
    for column in ("KIND", "STATE", "PID", "UPTIME", "RSS", "MLX ACTIVE", "MLX PEAK", "QUEUED",
                   "IN-FLIGHT", "TOK/S (1m)", "CACHE HITS", "CACHE MEM"):
        assert column in header
    row = lines[lines.index(header) + 1].split()
    assert row[:3] == [model_id, "text", "ready"]
    # The prompt cache's figures come with the worker's heartbeats (about one a second):
    # on a server just started, the first may still be on its way.
    deadline = time.monotonic() + 10
    while True:
        body = json.loads(ok(mlxctl(server, "status", "--json")).stdout)
        (w,) = body["workers"]
        if w["prompt_cache"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert w["model"] == model_id and w["pid"] == server.worker_pids()[0]
    assert w["rss_bytes"] > 1 << 20 and w["active_bytes"] > 0 and w["peak_bytes"] >= w["active_bytes"]
    assert set(w["prompt_cache"]) >= {"hits", "misses", "tokens_reused", "bytes", "evictions"}
    assert body["memory"]["available_bytes"] > 0 and body["server"]["rss_bytes"] > 0
    assert str(server.state_dir) == body["server"]["state_dir"]


def test_models_and_logs(server, model_id):
    body = json.loads(ok(mlxctl(server, "models", "--json")).stdout)
    (m,) = [m for m in body["models"] if m["id"] == model_id]
    assert m["state"] == "ready" and m["size_bytes"] > 0 and m["context_length"] == 4096
    text = ok(mlxctl(server, "models")).stdout
    assert text.splitlines()[0].split()[:3] == ["MODEL", "SIZE", "CONTEXT"]
    assert model_id in text
    logs = ok(mlxctl(server, "logs", "-n", "200")).stdout
    assert "mlxd serving" in logs or "ready" in logs


def test_lifecycle_commands(tiny_model, models_dir, tmp_path):
    from worker.demos.text import build_model
    a = str(tiny_model)
    b = str(build_model(models_dir / "tiny-b", "tiny", seed=2).path)
    with ServerProcess([a], state_dir=tmp_path) as srv:
        srv.wait_healthy()
        out = json.loads(ok(mlxctl(srv, "load", b, "--json")).stdout)
        assert out == {"model": b, "state": "ready", "context_length": 4096}
        status = json.loads(ok(mlxctl(srv, "status", "--json")).stdout)
        assert {w["model"] for w in status["workers"]} == {a, b}
        pid_a = next(w["pid"] for w in status["workers"] if w["model"] == a)
        killed = json.loads(ok(mlxctl(srv, "kill", a, "--json")).stdout)["killed"]
        assert killed == [{"model": a, "cancelled": 0, "restarted": True}]
        wait_for(lambda: next(w for w in json.loads(mlxctl(srv, "status", "--json").stdout)["workers"]
                              if w["model"] == a)["state"] == "ready", 30, interval=0.2)
        status = json.loads(ok(mlxctl(srv, "status", "--json")).stdout)
        w_a = next(w for w in status["workers"] if w["model"] == a)
        assert w_a["pid"] != pid_a and w_a["restart_causes"] == {"admin": 1}
        assert "unloaded" in ok(mlxctl(srv, "unload", b)).stdout
        text = ok(mlxctl(srv, "swap", b, "--force")).stdout
        assert text.startswith(f"swapped to {b} (force)") and f"unloaded: {a}" in text
        out = ok(mlxctl(srv, "kill", "--no-restart", "--json"))
        assert json.loads(out.stdout)["killed"][0]["restarted"] is False
        # Errors: the server's message, exit 1.
        missing = mlxctl(srv, "unload", "nothing-loaded")
        assert missing.returncode == 1 and "does not exist" in missing.stderr
        nothing = mlxctl(srv, "kill")
        assert nothing.returncode == 1 and "No model is loaded" in nothing.stderr
        idle = mlxctl(srv, "status")
        assert idle.returncode == 0 and "no model loaded" in idle.stdout


def test_admin_refusals(server, tmp_path):
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        r = httpx.get(server.url + "/admin/status", headers=headers, timeout=10)
        assert_envelope(r, 401, "invalid_api_key")
        r = httpx.post(server.url + "/admin/swap", json={"model": "x"}, headers=headers, timeout=10)
        assert_envelope(r, 401)
    # mlxctl with another state directory has no token, and says where it looked.
    out = mlxctl(server, "status", state_dir=tmp_path)
    assert out.returncode == 4 and "no admin token" in out.stderr and str(tmp_path) in out.stderr
    (tmp_path / "admin-token").write_text("wrong\n")
    out = mlxctl(server, "status", state_dir=tmp_path)
    assert out.returncode == 4 and "refused the admin token" in out.stderr


def test_says_when_the_server_is_not_running(tmp_path):
    out = mlxctl(f"http://127.0.0.1:{free_port()}", "status", state_dir=tmp_path)
    assert out.returncode == 3
    assert "not running" in out.stderr and "Traceback" not in out.stderr
