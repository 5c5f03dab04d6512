"""A worker killed while it verifies drafts (worker/speculative/) loses nothing: the
stream it was decoding ends with a clean, retryable error, the request queued behind it
is served by the respawned worker, which speculates again (real processes over HTTP)."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx

from tests.integration.test_faults import wait_for, worker
from tests.serverproc import ServerProcess

# (The tiny model falls into a loop on this prompt after about 40 tokens: from there
# prompt lookup drafts, and the model accepts, every step.)
REPEATING = "word one two three " * 10


def test_worker_killed_mid_verification_requeues_cleanly(tiny_model):
    model = str(tiny_model)
    with ServerProcess([model], "--max-batch-size", "1", "--speculative", "prompt-lookup",
                       "--heartbeat-interval", "0.05") as srv:
        srv.wait_healthy()
        pid = srv.worker_pids()[0]
        body = {"model": model, "prompt": REPEATING, "temperature": 0, "max_tokens": 3000,
                "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as http, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            with http.stream("POST", "/v1/completions", json=body) as s:
                lines = s.iter_lines()
                assert next(l for l in lines if l.startswith("data: "))
                queued = pool.submit(lambda: httpx.post(
                    srv.url + "/v1/completions", timeout=60,
                    json={"model": model, "prompt": REPEATING, "temperature": 0,
                          "max_tokens": 60}))
                wait_for(lambda: worker(srv)["in_flight"] == 2, 10)
                # Drafts being verified and accepted, step after step.
                wait_for(lambda: ((worker(srv).get("speculation") or {})
                                  .get("accepted", 0) > 20), 30)
                os.kill(pid, signal.SIGKILL)
                rest = [l for l in lines if l.startswith("data: ")]
            assert rest and '"error"' in rest[-1] and "worker_failed" in rest[-1]
            r = queued.result(timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60
            # The respawned worker speculates again, from zero: the queued request's drafts.
            w = wait_for(lambda: ((w := worker(srv))["speculation"] or {}).get("accepted")
                         and w, 10)
            assert w["restarts"] == 1 and w["pid"] != pid
            again = http.post("/v1/completions", json={"model": model, "prompt": REPEATING,
                                                       "temperature": 0, "max_tokens": 60})
            assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
