"""Running the server: logs, shutdown, mlxctl, configuration."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import httpx
import psutil
import pytest

from tests.serverproc import REPO, ServerProcess, free_port


def _all_logs(srv: ServerProcess) -> str:
    files = [srv.log_path, *sorted((srv.state_dir / "logs").glob("*.log*"))]
    return "".join(p.read_text(errors="replace") for p in files if p.exists())


@pytest.mark.parametrize("log_prompts", [False, True])
def test_logs_carry_prompt_text_only_with_log_prompts(tiny_model, tmp_path, log_prompts):
    secret = f"secret-{uuid.uuid4().hex}"
    args = ["--log-prompts"] if log_prompts else []
    with ServerProcess([str(tiny_model)], *args, state_dir=tmp_path) as srv:
        srv.wait_healthy()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": str(tiny_model), "messages": [{"role": "user", "content": secret}],
            "max_tokens": 3})
        assert r.status_code == 200
        rid = r.headers["X-Request-ID"]
        time.sleep(0.3)  # the worker's stderr reaches the supervisor's log
        logs = _all_logs(srv)
    assert rid in logs  # the request is logged, by id
    assert (secret in logs) is log_prompts


def test_sigterm_stops_workers_and_exits_zero(tiny_model):
    srv = ServerProcess([str(tiny_model)])
    srv.wait_healthy()
    pid = srv.worker_pids()[0]
    code = srv.stop()
    assert code == 0, srv.log()
    try:
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


def mlxctl(*args, url):
    return subprocess.run([sys.executable, "-m", "supervisor.ctl", "--url", url, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_mlxctl_status_text_and_json(server, model_id):
    out = mlxctl("status", url=server.url)
    assert out.returncode == 0, out.stderr
    assert "status: ok" in out.stdout and model_id in out.stdout and "ready" in out.stdout
    js = mlxctl("status", "--json", url=server.url)
    assert js.returncode == 0
    body = json.loads(js.stdout)
    assert body["workers"][0]["model"] == model_id


def test_mlxctl_says_when_the_server_is_not_running():
    out = mlxctl("status", url=f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 3
    assert "not running" in out.stderr and "Traceback" not in out.stderr


def test_mlxd_without_a_model_says_so():
    out = subprocess.run([sys.executable, "-m", "supervisor"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert out.returncode != 0 and "--model" in out.stderr


def test_sigterm_mid_stream_ends_the_stream_with_an_error_and_exits_quickly(tiny_model):
    srv = ServerProcess([str(tiny_model)])
    srv.wait_healthy()
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as s:
            lines = s.iter_lines()
            next(l for l in lines if l.startswith("data: "))
            t0 = time.monotonic()
            srv.proc.terminate()
            rest = [l for l in lines if l.startswith("data: ")]
    assert rest and "shutting down" in rest[-1]
    assert srv.proc.wait(15) == 0 and time.monotonic() - t0 < 10
    srv.stop()
