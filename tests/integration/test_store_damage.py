"""A damaged response store never stops the server (issue #9, finding 4), with real
processes: a garbage `responses.db` at start is moved aside, a store that fails while the
server runs turns only the store-backed routes into 503s until it is back, and a store
from a newer mlxd (healthy, not ours) is a clean refusal to start."""

from __future__ import annotations

import os
import random
import re
import sqlite3
import time

import httpx
import pytest

from tests.integration.conftest import assert_envelope
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

ASIDE = re.compile(r"responses\.db\.corrupt-\d{8}T\d{6}Z$")


def chat_ok(http, model):
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=10)
    assert r.status_code == 200, r.text


def create(http, model, **kw):
    return http.post("/v1/responses", json={"model": model, "input": "Tell me something",
                                            "max_output_tokens": 4, **kw})


def until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s")


def test_garbage_store_at_start_is_moved_aside(tiny_model, tmp_path):
    model = str(tiny_model)
    garbage = random.Random(4).randbytes(32 * 1024)
    (tmp_path / "responses.db").write_bytes(garbage)
    with ServerProcess([model], state_dir=tmp_path) as srv:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            chat_ok(http, model)
            r = create(http, model)
            assert r.status_code == 200, r.text
            got = http.get(f"/v1/responses/{r.json()['id']}")
            assert got.status_code == 200 and got.json() == r.json()
        log = srv.log(tail=None)
    (aside,) = [p for p in tmp_path.iterdir() if ASIDE.match(p.name)]
    assert aside.read_bytes() == garbage
    (line,) = [l for l in log.splitlines() if "damaged" in l]
    assert str(aside) in line and str(tmp_path / "responses.db") in line
    assert "Traceback" not in log


def test_store_failing_mid_run_only_fails_store_routes(tiny_model, tmp_path):
    model = str(tiny_model)
    db, moved = tmp_path / "responses.db", tmp_path / "moved.db"
    with ServerProcess([model], state_dir=tmp_path) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        srv.wait_healthy()
        kept = create(http, model).json()
        # A background response still generating when the store breaks: its final
        # write fails, and must neither crash nor be lost. Greedy and 2,000 tokens long
        # (seconds on the tiny model): 300 sampled ones took 0.2 s, short enough for a busy
        # CI machine to pause this test past the run's end before the store broke.
        bg = create(http, model, background=True, max_output_tokens=2000,
                    temperature=0).json()
        os.rename(db, moved)
        db.mkdir()  # not a database: every reopen fails until the file is put back
        for method, path, body in [
                ("GET", f"/v1/responses/{kept['id']}", None),
                ("GET", f"/v1/responses/{kept['id']}/input_items", None),
                ("DELETE", f"/v1/responses/{kept['id']}", None),
                ("POST", f"/v1/responses/{bg['id']}/cancel", None),
                ("POST", "/v1/responses", {"model": model, "input": "hi"}),
                ("POST", "/v1/responses", {"model": model, "input": "hi", "store": False,
                                           "previous_response_id": kept["id"]})]:
            r = http.request(method, path, json=body)
            err = assert_envelope(r, 503, "store_unavailable")
            assert err["type"] == "server_error" and int(r.headers["Retry-After"]) >= 1
        # Generation does not need the store; /health says the store is down, still 200.
        chat_ok(http, model)
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["store"] == "unavailable"
        assert health.json()["status"] == "degraded" and "store" in health.json()["reason"]
        assert create(http, model, store=False).status_code == 200
        assert "ended" in until(lambda: [l for l in srv.log(tail=None).splitlines()
                                         if bg["id"] in l and "store was unavailable" in l],
                                30, "the background run's end")[0]
        db.rmdir()
        os.rename(moved, db)

        def kept_again():
            r = http.get(f"/v1/responses/{kept['id']}")
            return r if r.status_code == 200 else None

        assert until(kept_again, 20, "the store's return").json() == kept  # nothing emptied
        until(lambda: "final state written" in srv.log(tail=None), 20, "the final write")
        health = http.get("/health").json()  # a write went through: the store is back
        assert health["store"] == "ok" and health["status"] == "ok"
        # Its final state: the 2,000-token limit (incomplete), or an end-of-sequence the
        # random tiny model chose first on another backend's numerics (completed).
        assert http.get(f"/v1/responses/{bg['id']}").json()["status"] in ("incomplete",
                                                                          "completed")
        fresh = create(http, model).json()
        assert http.get(f"/v1/responses/{fresh['id']}").json() == fresh
        log = srv.log(tail=None)
    assert "Traceback" not in log and "never retrieved" not in log


def test_newer_schema_is_a_clean_refusal(tiny_model, tmp_path):
    db = sqlite3.connect(tmp_path / "responses.db")
    db.execute("PRAGMA user_version=99")
    db.close()
    data = (tmp_path / "responses.db").read_bytes()
    with ServerProcess([str(tiny_model)], state_dir=tmp_path) as srv:
        assert srv.proc.wait(30) == 2
        log = srv.log(tail=None)
    assert "newer than this mlxd" in log and "Traceback" not in log
    assert (tmp_path / "responses.db").read_bytes() == data
    assert not [p for p in tmp_path.iterdir() if "corrupt" in p.name]
