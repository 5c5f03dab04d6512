"""Running the server: logs, shutdown, mlxctl, configuration."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import httpx
import psutil
import pytest

from tests.serverproc import REPO, ServerProcess


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


def test_mlxd_without_a_model_says_so():
    out = subprocess.run([sys.executable, "-m", "supervisor"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert out.returncode != 0 and "--model" in out.stderr


def test_sigterm_drains_running_requests_then_exits_zero(tiny_model):
    srv = ServerProcess([str(tiny_model)])
    srv.wait_healthy()
    pid = srv.worker_pids()[0]
    # Greedy on this prompt runs to max_tokens (no stop token comes): ~3 s of decoding.
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "Go on"}],
            "temperature": 0, "max_tokens": 2000, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as s:
            lines = s.iter_lines()
            next(l for l in lines if l.startswith("data: "))
            srv.proc.terminate()
            # Not accepting any more: the listening socket closes first.
            deadline = time.monotonic() + 5
            while True:
                try:
                    httpx.get(srv.url + "/health", timeout=1)
                except httpx.TransportError:
                    break
                assert time.monotonic() < deadline, "still accepting after SIGTERM"
                time.sleep(0.02)
            rest = [l for l in lines if l.startswith("data: ")]
    # The running request finished whole.
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 2000
    assert srv.proc.wait(30) == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "letting 1 request(s) finish" in _all_logs(srv)
    srv.stop()


def test_sigint_past_the_drain_timeout_ends_the_stream_with_an_error(tiny_model):
    # SIGINT (Ctrl-C) takes the same path as SIGTERM; this stream outlasts the drain.
    srv = ServerProcess([str(tiny_model)], "--shutdown-timeout", "0.5")
    srv.wait_healthy()
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "Go on"}],
            "temperature": 0, "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as s:
            lines = s.iter_lines()
            next(l for l in lines if l.startswith("data: "))
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGINT)
            rest = [l for l in lines if l.startswith("data: ")]
    assert rest and "shutting down" in rest[-1]
    assert time.monotonic() - t0 >= 0.5  # it had its drain first
    assert srv.proc.wait(15) == 0 and time.monotonic() - t0 < 10
    srv.stop()


def test_an_idle_worker_keeps_its_buffer_cache_for_buffer_cache_idle(tiny_model):
    # A request's freed buffers stay in MLX's cache while the worker idles less than
    # --buffer-cache-idle (the next turn reuses them), and go back to the system after:
    # /health's cache_bytes, from the worker's heartbeats. (The default, 60 s, would
    # outlast the wait below.)
    with ServerProcess([str(tiny_model)], "--buffer-cache-idle", "8") as srv:
        srv.wait_healthy()

        def cache_bytes():
            _, body = srv.get("/health")
            return body["workers"][0]["cache_bytes"]

        def until(check, limit):
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                if check():
                    return time.monotonic()
                time.sleep(0.1)
            raise AssertionError(f"not within {limit} s")

        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": str(tiny_model), "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello there"}]})
        done = time.monotonic()
        assert r.status_code == 200
        until(lambda: cache_bytes() > 0, 3)
        time.sleep(max(0.0, done + 3 - time.monotonic()))
        assert cache_bytes() > 0  # (3 s idle: kept, where the worker once gave it back at 2)
        until(lambda: cache_bytes() == 0, 40)
