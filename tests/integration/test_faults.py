"""Faults with real processes: worker killed mid-stream, client disconnect, supervisor
killed, queue and time limits."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import psutil
import pytest

from tests.integration.conftest import assert_envelope, sse_events
from tests.serverproc import ServerProcess


def long_stream_body(model, tokens=3000):
    return {"model": model, "messages": [{"role": "user", "content": "Go on"}],
            "temperature": 0, "max_tokens": tokens, "stream": True}


def wait_for(predicate, timeout, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def worker(srv) -> dict:
    _, body = srv.get("/health")
    return body["workers"][0]


def test_worker_killed_mid_stream(tiny_model):
    model = str(tiny_model)
    with ServerProcess([model], "--max-batch-size", "1") as srv:
        srv.wait_healthy()
        pid = srv.worker_pids()[0]
        with httpx.Client(base_url=srv.url, timeout=60) as http, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            with http.stream("POST", "/v1/chat/completions", json=long_stream_body(model)) as s:
                lines = s.iter_lines()
                assert next(l for l in lines if l.startswith("data: "))
                # A request waiting behind the stream (one sequence at a time): sent ahead
                # to the worker to be prepared, not started.
                queued = pool.submit(lambda: httpx.post(
                    srv.url + "/v1/chat/completions", timeout=60,
                    json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 5}))
                wait_for(lambda: worker(srv)["in_flight"] == 2, 5)
                os.kill(pid, signal.SIGKILL)
                rest = [l for l in lines if l.startswith("data: ")]
            # The stream ends with a clean, retryable error event, not a hang or a cut.
            assert rest and '"error"' in rest[-1] and "worker_failed" in rest[-1]
            assert "Traceback" not in rest[-1]
            # The queued request is served by the respawned worker: nothing lost.
            r = queued.result(timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            r = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 200
        w = worker(srv)
        assert w["restarts"] == 1 and w["pid"] != pid and w["state"] == "ready"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_client_disconnect_drops_the_sequence(models_dir):
    # The small model (~25 ms a step here) makes "within a few steps" measurable.
    from worker.demos.text import build_model
    small = str(build_model(models_dir / "small", "small").path)
    with ServerProcess([small], "--heartbeat-interval", "0.05") as srv:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=long_stream_body(small, 2000)) as s:
                lines = s.iter_lines()
                for _ in range(4):
                    next(l for l in lines if l.startswith("data: "))
                s.close()  # the client goes away mid-stream
            steps_at_close = worker(srv)["steps"]
            wait_for(lambda: worker(srv)["in_flight"] == 0 and worker(srv)["worker_active"] == 0, 5)
            dropped_at = worker(srv)["steps"]
            time.sleep(0.5)
            w = worker(srv)
        assert w["steps"] == dropped_at, "the worker kept generating after the drop"
        # Heartbeats are 50 ms apart (~2 steps); the drop itself is within one step.
        assert dropped_at - steps_at_close <= 8, (steps_at_close, dropped_at)
        assert w["restarts"] == 0  # cancelled cooperatively, not killed


def test_supervisor_killed_takes_workers_with_it(tiny_model):
    srv = ServerProcess([str(tiny_model)])
    try:
        srv.wait_healthy()
        pid = srv.worker_pids()[0]
        srv.proc.kill()
        srv.proc.wait()
        t0 = time.monotonic()

        def gone():
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True
        wait_for(gone, 2.0)
        assert time.monotonic() - t0 <= 2.0
    finally:
        srv.stop()


def test_queue_limits_and_timeouts(tiny_model):
    model = str(tiny_model)
    # One sequence at a time, so a second request waits (what --max-queue counts).
    with ServerProcess([model], "--max-queue", "1", "--queue-timeout", "1",
                       "--request-timeout", "2", "--max-batch-size", "1") as srv:
        srv.wait_healthy()
        long_body = {**long_stream_body(model), "stream": False}
        with httpx.Client(base_url=srv.url, timeout=60) as http, \
                concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = pool.submit(http.post, "/v1/chat/completions", json=long_body)
            # Started (sent and not started would count against --max-queue itself).
            wait_for(lambda: (w := worker(srv))["in_flight"] == 1 and w["waiting"] == 0, 5)
            waiting = pool.submit(http.post, "/v1/chat/completions", json=long_body)
            wait_for(lambda: (w := worker(srv))["in_flight"] == 2 and w["waiting"] == 1, 5)
            full = http.post("/v1/chat/completions", json=long_body)
            err = assert_envelope(full, 503)
            assert int(full.headers["Retry-After"]) >= 1 and "retry" in err["message"].lower()
            late = waiting.result(timeout=30)  # waited over --queue-timeout
            assert_envelope(late, 503)
            assert "Retry-After" in late.headers
            assert_envelope(running.result(timeout=30), 504, "timeout")  # over --request-timeout
            # Streaming: the timeout arrives as the stream's last event.
            with http.stream("POST", "/v1/chat/completions", json=long_stream_body(model)) as s:
                assert s.status_code == 200
                events = sse_events(s)
            assert events[-1]["error"]["code"] == "timeout"
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            wait_for(lambda: worker(srv)["in_flight"] == 0, 5)
            assert worker(srv)["restarts"] == 0


def test_random_demo_model_serves(tmp_path):
    with ServerProcess(["demo-random"], state_dir=tmp_path) as srv:
        body = srv.wait_healthy(timeout=180)
        assert body["workers"][0]["random_weights"] is True
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": "demo-random",
                             "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4})
        assert r.status_code == 200
        listing = httpx.get(srv.url + "/v1/models").json()
        assert listing["data"][0]["id"] == "demo-random"
        assert (tmp_path / "models" / "demo-random").is_dir()  # built into the state dir


def test_missing_model_makes_health_say_why(tmp_path):
    with ServerProcess([str(tmp_path / "nowhere")], state_dir=tmp_path) as srv:
        def broken():
            try:
                code, body = srv.get("/health")
            except OSError:  # not listening yet
                assert srv.proc.poll() is None, srv.log()
                return False
            return code == 503 and body["workers"][0]["state"] == "broken" and body
        body = wait_for(broken, 60, 0.1)
        assert "nowhere" in body["reason"]


def test_waiting_for_a_server_whose_model_is_broken_ends_at_once(tmp_path):
    """The helper every integration test starts servers with: a model that failed to load
    ends its wait for health with the reason, not after its whole timeout."""
    with ServerProcess([str(tmp_path / "nowhere")], state_dir=tmp_path) as srv:
        with pytest.raises(RuntimeError, match="broken") as e:
            srv.wait_healthy(timeout=3600)
        assert "nowhere" in str(e.value)


def test_context_too_long_is_refused_at_once_behind_a_long_generation(tiny_model):
    """Requests reach the worker's tokenizer on arrival, not when a slot frees: one that
    cannot fit gets its 400 while a 2000-token generation runs on the same worker."""
    model = str(tiny_model)
    with ServerProcess([model]) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        srv.wait_healthy()
        with http.stream("POST", "/v1/chat/completions", json=long_stream_body(model, 2000)) as s:
            lines = s.iter_lines()
            assert next(l for l in lines if l.startswith("data: "))
            too_long = {"model": model, "max_tokens": 10,
                        "messages": [{"role": "user", "content": "word " * 5000}]}
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json=too_long)
            elapsed = time.monotonic() - t0
            assert_envelope(r, 400, "context_length_exceeded")
            assert elapsed < 1.0, f"the refusal waited {elapsed:.2f} s behind the stream"
            assert worker(srv)["in_flight"] == 1  # the stream still runs, untouched
            rest = [l for l in lines if l.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
