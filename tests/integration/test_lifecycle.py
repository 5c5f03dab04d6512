"""Model lifecycle with real processes: swaps under load, several resident models, LRU
eviction, keep-alive, the memory gate (readings injected through --memory-probe), and
load-on-request of a model in the Hugging Face cache."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import psutil
import pytest

from tests.hfcache import add_to_cache
from tests.integration.conftest import assert_envelope
from tests.integration.test_faults import long_stream_body, wait_for
from tests.serverproc import ServerProcess

GiB = 1 << 30


@pytest.fixture(scope="module")
def model_b(models_dir):
    from worker.demos.text import build_model
    return build_model(models_dir / "tiny-b", "tiny", seed=2).path


@pytest.fixture(scope="module")
def model_c(models_dir):
    from worker.demos.text import build_model
    return build_model(models_dir / "tiny-c", "tiny", seed=3).path


def chat(srv, model, max_tokens=4, timeout=60) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=timeout, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
        "temperature": 0})  # (greedy: a sampled end-of-text would cut the counts asserted)


def workers(srv) -> dict:
    _, body = srv.get("/health")
    return {w["model"]: w for w in body["workers"]}


def admin(srv, method, path, body=None, timeout=120) -> httpx.Response:
    token = (srv.state_dir / "admin-token").read_text().strip()
    return httpx.request(method, srv.url + path, json=body, timeout=timeout,
                         headers={"Authorization": f"Bearer {token}"})


def timed(fn, *args):
    out = fn(*args)
    return out, time.monotonic()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("mode", ["drain", "force"])
def test_swap_under_load(tiny_model, model_b, mode):
    a, b = str(tiny_model), str(model_b)
    # One sequence at a time, so the second request waits behind the stream.
    with ServerProcess([a], "--max-batch-size", "1") as srv:
        srv.wait_healthy()
        pid_a = srv.worker_pids()[0]
        if mode == "force":  # `b` resident first, so the swap retires `a` at once: on a
            # loaded machine, loading `b` during the swap outlasted the whole stream
            r = admin(srv, "POST", "/admin/load", {"model": b})
            assert r.status_code == 200, r.text
        with httpx.Client(base_url=srv.url, timeout=120) as http, \
                concurrent.futures.ThreadPoolExecutor(2) as pool:
            body = {**long_stream_body(a, 3000), "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/chat/completions", json=body) as s:
                lines = s.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                queued = pool.submit(chat, srv, a, 5)  # waits behind the stream on `a`
                wait_for(lambda: workers(srv)[a]["in_flight"] == 2, 10)  # sent ahead
                swap = pool.submit(timed, admin, srv, "POST", "/admin/swap", {"model": b, "mode": mode})
                rest = [line for line in lines if line.startswith("data: ")]
                stream_ended = time.monotonic()
            r, swap_ended = swap.result(timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["replaced"] == [a] and r.json()["model"] == b
            if mode == "drain":  # the stream on the old model completes, then the swap
                assert swap_ended >= stream_ended
                assert rest[-1] == "data: [DONE]"
                usage = json.loads(rest[-2][6:])["usage"]
                assert usage["completion_tokens"] == 3000
            else:  # it ends with a clean, retryable error event
                event = json.loads(rest[-1][6:])
                assert event["error"]["code"] == "worker_failed"
                assert "unloaded" in event["error"]["message"]
            # The request queued for `a` is served by a worker of `a`, never dropped.
            q = queued.result(timeout=120)
            assert q.status_code == 200 and q.json()["model"] == a
            assert q.json()["usage"]["completion_tokens"] == 5
        assert gone(pid_a)
        assert workers(srv)[b]["state"] == "ready"
        assert chat(srv, b).status_code == 200
        if mode == "drain":
            assert set(workers(srv)) == {b}


def test_two_resident_models_answer_alternately(tiny_model, model_b):
    a, b = str(tiny_model), str(model_b)
    with ServerProcess([a, b]) as srv:
        srv.wait_healthy()
        pids = {m: w["pid"] for m, w in workers(srv).items()}
        assert set(pids) == {a, b}
        for i in range(6):
            model = (a, b)[i % 2]
            r = chat(srv, model)
            assert r.status_code == 200 and r.json()["model"] == model
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda m: chat(srv, m, 20), [a, b, a, b]))
        assert [r.json()["model"] for r in rs] == [a, b, a, b]
        assert all(r.status_code == 200 for r in rs)
        now = workers(srv)
        assert {m: w["pid"] for m, w in now.items()} == pids  # nothing reloaded
        assert all(w["restarts"] == 0 for w in now.values())


def test_lru_eviction_and_keep_alive_expiry(tiny_model, model_b, model_c):
    a, b, c = str(tiny_model), str(model_b), str(model_c)
    with ServerProcess([a], "--max-models", "2", "--keep-alive", "2",
                       "--models-dir", str(tiny_model.parent)) as srv:
        srv.wait_healthy()
        assert chat(srv, b).status_code == 200       # loaded on request: 2 resident
        assert set(workers(srv)) == {a, b}
        pid_b = workers(srv)[b]["pid"]
        assert chat(srv, a).status_code == 200       # a is now used more recently than b
        assert chat(srv, c).status_code == 200       # full: the LRU idle one (b) makes room
        assert set(workers(srv)) == {a, c}
        assert gone(pid_b)
        last_use = time.monotonic()
        # c came on request: unloaded once idle past --keep-alive; a (--model) stays.
        wait_for(lambda: set(workers(srv)) == {a}, 20, interval=0.1)
        assert time.monotonic() - last_use >= 2 - 0.05  # last_use is the client's, a bit late
        assert workers(srv)[a]["state"] == "ready"
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'mlxd_model_unloads_total{reason="max-models"} 1.0' in metrics
        assert 'mlxd_model_unloads_total{reason="keep-alive"} 1.0' in metrics


def test_memory_gate_refuses_with_507_then_waits_for_memory(tiny_model, model_b, tmp_path):
    a, b = str(tiny_model), str(model_b)
    probe = tmp_path / "memory.json"
    probe.write_text(json.dumps({"available_bytes": 64 * GiB}))
    with ServerProcess([a], "--memory-probe", str(probe), "--memory-wait", "2",
                       "--kv-budget", "1G", "--memory-factor", "1.0",
                       "--models-dir", str(tiny_model.parent)) as srv:
        srv.wait_healthy()
        probe.write_text(json.dumps({"available_bytes": GiB // 2}))
        t0 = time.monotonic()
        r = chat(srv, b)
        err = assert_envelope(r, 507, "insufficient_memory")
        assert time.monotonic() - t0 >= 2  # it waited --memory-wait for memory first
        assert "needs about 1.0 GiB" in err["message"] and "0.5 GiB is available" in err["message"]
        assert b not in workers(srv)
        # Again, and this time memory appears while the load waits at the gate.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, srv, b)
            wait_for(lambda: workers(srv).get(b, {}).get("state") == "waiting", 10)
            probe.write_text(json.dumps({"available_bytes": 8 * GiB}))
            r = pending.result(timeout=60)
        assert r.status_code == 200 and r.json()["model"] == b
        assert workers(srv)[b]["state"] == "ready"


def test_cached_hf_model_is_listed_and_loads_on_request(tiny_model, tmp_path):
    cache = tmp_path / "hub"
    add_to_cache(tiny_model, cache, "mlx-community/tiny-test")
    with ServerProcess([str(tiny_model)], env={"HF_HUB_CACHE": str(cache)}) as srv:
        srv.wait_healthy()
        listing = {m["id"]: m for m in httpx.get(srv.url + "/v1/models").json()["data"]}
        entry = listing["mlx-community/tiny-test"]
        assert entry["state"] == "not_loaded" and entry["context_length"] == 4096
        r = chat(srv, "mlx-community/tiny-test")
        assert r.status_code == 200 and r.json()["model"] == "mlx-community/tiny-test"
        assert workers(srv)["mlx-community/tiny-test"]["state"] == "ready"
        assert_envelope(chat(srv, "mlx-community/not-there"), 404, "model_not_found")


def test_load_on_request_can_be_switched_off(tiny_model, model_b):
    with ServerProcess([str(tiny_model)], "--no-allow-load-on-request") as srv:
        srv.wait_healthy()
        assert_envelope(chat(srv, str(model_b)), 404, "model_not_found")
        assert set(workers(srv)) == {str(tiny_model)}
