"""Faults of real worker processes under a real supervisor, each with bounded waits:
a crash mid-generation (worker/faults.py), a crash loop, a frozen worker (SIGSTOP), weights
that cannot load. Every client gets a clean, retryable error or its answer after the
respawn; stored responses are never lost; /health and /metrics say what happened."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import httpx
import pytest

from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration
FAULT = {"MLXD_TEST_FAULTS": "crash_after_tokens=6"}


def chat(model: str, max_tokens: int, stream: bool = False) -> dict:
    # Greedy: the tiny model never picks EOS then (worker/demos/text.py), so a stream runs to
    # max_tokens. Sampled, EOS could end it early, before the fault a test injects.
    return {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": stream, "temperature": 0}


def stream_outcome(http: httpx.Client, body: dict) -> str:
    """'done' (the stream ended with [DONE]) or the error's code (its last event)."""
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        last = None
        for line in r.iter_lines():
            if line.startswith("data: "):
                last = line[6:]
    if last == "[DONE]":
        return "done"
    return json.loads(last)["error"]["code"]


def health(srv) -> tuple[int, dict] | tuple[None, dict]:
    """/health's status and body; (None, {}) while the server is not listening yet."""
    try:
        return srv.get("/health")
    except OSError:
        return None, {}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def test_a_crash_mid_generation_fails_the_running_request_and_serves_the_queued(tiny_model):
    model = str(tiny_model)
    with ServerProcess([model], "--max-batch-size", "1", env=FAULT) as srv:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            # Stored before the crash: it must survive it (and the restart after).
            stored = http.post("/v1/responses", json={"model": model, "input": "hi",
                                                      "max_output_tokens": 3}).json()
            queued: dict = {}
            first_pid = srv.worker_pids()[0]

            def second():  # sent while the first runs: it waits, then meets a new worker
                time.sleep(0.3)
                queued["r"] = http.post("/v1/chat/completions", json=chat(model, 3))

            t = threading.Thread(target=second)
            t.start()
            assert stream_outcome(http, chat(model, 40, stream=True)) == "worker_failed"
            t.join(60)
            assert queued["r"].status_code == 200, queued["r"].text
            assert queued["r"].json()["usage"]["completion_tokens"] == 3
            assert srv.worker_pids()[0] != first_pid
            _, body = srv.get("/health")
            worker = body["workers"][0]
            assert worker["restarts"] >= 1 and worker["restart_causes"].get("crash", 0) >= 1
            metrics = http.get("/metrics").text
            assert 'mlxd_worker_restarts_total{cause="crash"' in metrics
            got = http.get(f"/v1/responses/{stored['id']}")
            assert got.status_code == 200 and got.json()["status"] in ("completed", "incomplete")


def test_a_crash_loop_marks_the_model_broken_and_says_so(tiny_model):
    model = str(tiny_model)
    with ServerProcess([model], "--crash-budget", "2", "--restart-backoff", "0.1",
                       env=FAULT) as srv:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            codes = []
            for _ in range(6):
                r = http.post("/v1/chat/completions", json=chat(model, 20))
                codes.append(r.status_code)
                if r.status_code == 503 and "crash loop" in r.text:
                    break
            assert 200 not in codes and set(codes) <= {502, 503}
            status, body = wait_for(lambda: (lambda s, b: (s, b) if s == 503 else None)(
                *health(srv)), 30, "health turning 503")
            worker = body["workers"][0]
            assert worker["state"] == "broken" and "crash loop" in worker["last_error"]
            r = http.post("/v1/chat/completions", json=chat(model, 2))
            assert r.status_code == 503 and r.json()["error"]["message"]


def test_a_frozen_worker_is_replaced_and_its_client_told(tiny_model):
    model = str(tiny_model)
    with ServerProcess([model], "--heartbeat-timeout", "2") as srv:
        srv.wait_healthy()
        pid = srv.worker_pids()[0]
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            t0 = time.monotonic()
            stopper = threading.Timer(0.3, os.kill, (pid, signal.SIGSTOP))
            stopper.start()
            assert stream_outcome(http, chat(model, 4000, stream=True)) == "worker_failed"
            assert time.monotonic() - t0 < 15  # the heartbeat timeout, not forever
            stopper.join()
            r = http.post("/v1/chat/completions", json=chat(model, 3))
            assert r.status_code == 200
            _, body = srv.get("/health")
            assert body["workers"][0]["restart_causes"].get("heartbeat") == 1
        try:
            os.kill(pid, signal.SIGKILL)  # (the supervisor killed it; make sure)
        except ProcessLookupError:
            pass


def test_weights_that_cannot_load_are_a_clear_error_not_a_hang(tiny_model, tmp_path):
    bad = tmp_path / "bad-weights"
    shutil.copytree(tiny_model, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)  # not safetensors any more
    with ServerProcess([str(bad)]) as srv:
        status, body = wait_for(lambda: (lambda s, b: (s, b) if b.get("workers") and
                                         b["workers"][0]["state"] == "broken" else None)(
            *health(srv)), 60, "the model marked broken")
        assert status == 503 and "load" in body["workers"][0]["last_error"]
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json=chat(str(bad), 2))
            assert r.status_code == 503 and time.monotonic() - t0 < 5
            assert "load" in r.json()["error"]["message"]
