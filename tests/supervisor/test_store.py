"""The SQLite response store: durability, chains, bounds, migrations, privacy."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading

import pytest

from supervisor.store import MIGRATIONS, ChainError, ResponseStore, StoredResponse


def rec(rid, prev=None, status="completed", at=1000.0, text="x"):
    return StoredResponse(rid, at, status, {"id": rid, "status": status, "output": [text]},
                          [{"type": "message", "role": "user", "content": rid}], prev)


@pytest.fixture
async def store(tmp_path):
    s = ResponseStore(tmp_path / "responses.db", clock=lambda: 2000.0, max_age_s=10_000)
    await s.open()
    yield s
    await s.close()


async def test_put_get_update_delete(store):
    await store.put(rec("a"))
    got = await store.get("a")
    assert got.response == {"id": "a", "status": "completed", "output": ["x"]}
    assert got.input_items[0]["content"] == "a"
    assert await store.update("a", "cancelled", {"id": "a", "status": "cancelled"})
    assert (await store.get("a")).status == "cancelled"
    assert await store.delete("a") and not await store.delete("a")
    assert await store.get("a") is None


async def test_chain_oldest_first_with_depth_limit_and_cycles(store):
    await store.put(rec("a"))
    await store.put(rec("b", "a"))
    await store.put(rec("c", "b"))
    assert [r.id for r in await store.chain("c", 10)] == ["a", "b", "c"]
    with pytest.raises(ChainError, match="deeper"):
        await store.chain("c", 2)
    await store.put(rec("a", "c"))  # a loop a → c → b → a
    with pytest.raises(ChainError, match="loops"):
        await store.chain("c", 10)
    await store.delete("b")
    with pytest.raises(ChainError) as e:
        await store.chain("c", 10)
    assert e.value.missing_id == "b"


async def test_bounded_by_count_and_age(tmp_path):
    now = [1000.0]
    s = ResponseStore(tmp_path / "r.db", max_count=3, max_age_s=100, clock=lambda: now[0])
    await s.open()
    try:
        for i in range(5):
            await s.put(rec(f"r{i}", at=1000.0 + i))
        assert await s.count() == 3
        assert await s.get("r0") is None and await s.get("r1") is None
        assert (await s.get("r4")) is not None
        now[0] = 1103.5  # r2 and r3 are now older than max_age
        assert await s.get("r2") is None and await s.get("r4") is not None
        await s.put(rec("r5", at=1103.5))
        assert await s.count() == 2  # the expired ones are gone from disk too
    finally:
        await s.close()


async def test_survives_reopen_and_fails_unfinished(tmp_path):
    path = tmp_path / "r.db"
    s = ResponseStore(path, clock=lambda: 1000.0)
    await s.open()
    await s.put(rec("done"))
    await s.put(rec("running", status="in_progress"))
    await s.close()
    s2 = ResponseStore(path, clock=lambda: 1000.0)
    assert await s2.open() == 1
    try:
        assert (await s2.get("done")).status == "completed"
        failed = await s2.get("running")
        assert failed.status == "failed" and failed.response["status"] == "failed"
        assert "restarted" in failed.response["error"]["message"]
    finally:
        await s2.close()


async def test_file_is_private_wal_and_versioned(store):
    await store.put(rec("a"))
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    db = sqlite3.connect(store.path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    finally:
        db.close()


async def test_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "r.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer"):
        await ResponseStore(path).open()


async def test_sqlite_work_happens_off_the_event_loop_thread(store):
    seen = []
    original = store._get

    def spy(rid):
        seen.append(threading.current_thread().name)
        return original(rid)

    store._get = spy
    await store.get("nothing")
    assert seen and seen[0].startswith("store") and seen[0] != threading.current_thread().name
