"""The SQLite response store: durability, chains, bounds, migrations, privacy, and
damage: found at open (moved aside) or met while running (unavailable, then reopened)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import shutil
import sqlite3
import stat
import threading
from pathlib import Path

import pytest

from supervisor.api.responses.store import (MIGRATIONS, RETRY_MIN_S, ChainError, ResponseStore, SchemaTooNew,
                              StoredResponse, StoreUnavailable)


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


# ---- damage at open ------------------------------------------------------------------

ASIDE = re.compile(r"responses\.db\.corrupt-\d{8}T\d{6}Z$")
PAGE = 4096  # SQLite's default page size


async def filled(path, n=60, size=2000):
    """A real, closed store of `n` responses of about `size` bytes each."""
    s = ResponseStore(path, clock=lambda: 1000.0)
    await s.open()
    for i in range(n):
        await s.put(rec(f"r{i}", text="x" * size))
    await s.close()


def rows(path) -> list:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT * FROM responses ORDER BY id").fetchall()
    finally:
        db.close()


def garbage_pages(path, first: int, count: int, seed: int = 7) -> dict:
    """Overwrite pages in place with random bytes; returns offset → the bytes written."""
    rnd, written = random.Random(seed), {}
    with open(path, "r+b") as f:
        for page in range(first, first + count):
            f.seek(page * PAGE)
            written[page * PAGE] = rnd.randbytes(PAGE)
            f.write(written[page * PAGE])
    return written


async def random_bytes(path):
    path.write_bytes(random.Random(1).randbytes(64 * 1024))
    for side in ("-wal", "-shm"):  # stale side files travel with it
        Path(f"{path}{side}").write_bytes(random.Random(side).randbytes(1000))


async def truncated(path):
    await filled(path)
    os.truncate(path, path.stat().st_size // 2)


async def garbage_in_the_middle(path):
    await filled(path)
    middle = path.stat().st_size // PAGE // 2
    garbage_pages(path, middle - 2, 4)


def warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", [random_bytes, truncated, garbage_in_the_middle])
async def test_damaged_store_is_moved_aside_and_replaced(tmp_path, caplog, damage):
    caplog.set_level(logging.INFO, logger="mlxd.store")
    path = tmp_path / "responses.db"
    await damage(path)
    original = {s: Path(f"{path}{s}").read_bytes() for s in ("", "-wal")
                if Path(f"{path}{s}").exists()}
    had_shm = Path(f"{path}-shm").exists()
    s = ResponseStore(path, clock=lambda: 1000.0)
    assert await s.open() == 0
    try:
        assert s.available and await s.get("r0") is None  # a fresh, empty store
        await s.put(rec("new"))
        assert (await s.get("new")).response["id"] == "new"
    finally:
        await s.close()
    (aside,) = [p for p in tmp_path.iterdir() if ASIDE.match(p.name)]
    for suffix, data in original.items():  # kept for the operator, bytes as found
        assert Path(f"{aside}{suffix}").read_bytes() == data
    # -shm is SQLite's index of the -wal, rebuilt by any reader: moved along, not frozen.
    assert Path(f"{aside}-shm").exists() or not had_shm
    assert not [p for p in tmp_path.iterdir() if "corrupt" in p.name
                and not p.name.startswith(aside.name)]  # one set of files, one name
    (line,) = warnings(caplog)
    assert "damaged" in line and str(path) in line and str(aside) in line


async def test_healthy_store_is_left_alone(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlxd.store")
    path = tmp_path / "responses.db"
    await filled(path)
    before = rows(path)
    s = ResponseStore(path, clock=lambda: 1000.0)
    await s.open()
    try:
        assert await s.count() == 60 and (await s.get("r59")).id == "r59"
    finally:
        await s.close()
    assert rows(path) == before and len(before) == 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["responses.db"]
    assert warnings(caplog) == []


async def test_wal_left_by_a_crash_is_not_damage(tmp_path, caplog):
    # Files copied while a store is open are what a killed supervisor leaves: rows still
    # only in the -wal. They must open with every row, nothing moved aside.
    caplog.set_level(logging.INFO, logger="mlxd.store")
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    crashed.mkdir()
    s = ResponseStore(live / "responses.db", clock=lambda: 1000.0)
    await s.open()
    try:
        for i in range(5):
            await s.put(rec(f"r{i}"))
        for name in ("responses.db", "responses.db-wal"):
            shutil.copy(live / name, crashed / name)
    finally:
        await s.close()
    s2 = ResponseStore(crashed / "responses.db", clock=lambda: 1000.0)
    await s2.open()
    try:
        assert await s2.count() == 5
    finally:
        await s2.close()
    assert not [p for p in crashed.iterdir() if "corrupt" in p.name]
    assert warnings(caplog) == []


async def test_newer_schema_is_refused_and_not_moved(tmp_path):
    path = tmp_path / "r.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    db.close()
    data = path.read_bytes()
    with pytest.raises(SchemaTooNew, match="newer"):
        await ResponseStore(path).open()
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.db"]


async def test_unopenable_at_start_serves_later(tmp_path):
    # Not damage (here: a directory where the file should be): open() does not raise,
    # the store answers unavailable, and opens once the path is usable.
    now = [0.0]
    path = tmp_path / "responses.db"
    path.mkdir()
    s = ResponseStore(path, clock=lambda: 1000.0, monotonic=lambda: now[0])
    assert await s.open() == 0
    try:
        with pytest.raises(StoreUnavailable):
            await s.get("a")
        path.rmdir()
        now[0] += RETRY_MIN_S
        await s.put(rec("a"))
        assert (await s.get("a")).id == "a"
    finally:
        await s.close()


# ---- failures while running ----------------------------------------------------------

@pytest.fixture
def now():
    return [0.0]


@pytest.fixture
async def live(tmp_path, now):
    s = ResponseStore(tmp_path / "responses.db", clock=lambda: 1000.0, monotonic=lambda: now[0])
    await s.open()
    await s.put(rec("a"))
    yield s
    await s.close()


def on_store_thread(store, fn, *args):
    """Do something to the store's connection on its own thread (sqlite3 objects do not
    cross threads)."""
    return asyncio.wrap_future(store._pool.submit(fn, *args))


async def test_connection_lost_then_reopened_on_schedule(live, now):
    await on_store_thread(live, live._db.close)
    with pytest.raises(StoreUnavailable) as e:
        await live.get("a")
    assert e.value.retry_after == pytest.approx(RETRY_MIN_S) and not live.available
    now[0] += RETRY_MIN_S / 2
    with pytest.raises(StoreUnavailable):  # would work now, but is not due: no disk work
        await live.get("a")
    now[0] += RETRY_MIN_S / 2
    assert (await live.get("a")).id == "a" and live.available


async def test_file_replaced_underneath_until_put_back(live, now, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlxd.store")
    moved = tmp_path / "elsewhere.db"
    os.rename(live.path, moved)
    live.path.mkdir()  # something that is not a database in its place
    with pytest.raises(StoreUnavailable):
        await live.get("a")
    now[0] += RETRY_MIN_S
    with pytest.raises(StoreUnavailable) as e:  # the retry fails: the wait doubles
        await live.put(rec("b"))
    assert e.value.retry_after == pytest.approx(2 * RETRY_MIN_S)
    live.path.rmdir()
    os.rename(moved, live.path)
    now[0] += 2 * RETRY_MIN_S
    assert (await live.get("a")).id == "a"  # the same data: nothing was emptied
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "unavailable" in errors[0]  # one line when it broke
    assert "available again" in caplog.records[-1].getMessage()


async def test_file_deleted_underneath_starts_empty(live, now, caplog):
    caplog.set_level(logging.INFO, logger="mlxd.store")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{live.path}{suffix}").unlink(missing_ok=True)
    with pytest.raises(StoreUnavailable):
        await live.put(rec("b"))
    now[0] += RETRY_MIN_S
    assert await live.get("a") is None
    await live.put(rec("b"))
    assert await live.count() == 1 and live.path.exists()
    assert any("was removed" in m for m in warnings(caplog))


async def test_disk_full_then_writable_again(live, now, caplog):
    caplog.set_level(logging.INFO, logger="mlxd.store")
    # SQLite's own SQLITE_FULL, as from a full disk: no page may be added.
    pages = (await on_store_thread(live, lambda: live._db.execute(
        "PRAGMA page_count").fetchone()))[0]
    await on_store_thread(live, live._db.execute, f"PRAGMA max_page_count={pages}")
    with pytest.raises(StoreUnavailable):
        await live.put(rec("big", text="x" * 100_000))
    assert any("SQLITE_FULL" in m for m in warnings(caplog))
    now[0] += RETRY_MIN_S
    await live.put(rec("big", text="x" * 100_000))
    assert (await live.get("big")) is not None and (await live.get("a")) is not None


async def test_damage_met_mid_run_is_moved_aside_on_reopen(tmp_path, now, caplog):
    caplog.set_level(logging.INFO, logger="mlxd.store")
    path = tmp_path / "responses.db"
    await filled(path, n=100)
    s = ResponseStore(path, clock=lambda: 1000.0, monotonic=lambda: now[0])
    await s.open()
    try:
        middle = path.stat().st_size // PAGE // 2
        written = garbage_pages(path, middle - 5, 10)
        other = sqlite3.connect(path)  # a commit elsewhere: the store's cached pages go stale
        other.execute(f"PRAGMA user_version={len(MIGRATIONS)}")
        other.close()
        failed = 0
        for i in range(100):
            try:
                await s.get(f"r{i}")
            except StoreUnavailable:
                failed += 1
                break
        assert failed, "no read met the damaged pages"
        assert any("SQLITE_CORRUPT" in m for m in warnings(caplog))
        now[0] += RETRY_MIN_S
        assert await s.get("r0") is None and s.available  # reopened empty
    finally:
        await s.close()
    (aside,) = [p for p in tmp_path.iterdir() if ASIDE.match(p.name)]
    data = aside.read_bytes()
    assert all(data[at:at + PAGE] == page for at, page in written.items())


async def test_missing_directory_is_not_invented(tmp_path, now):
    # The state directory gone (say, a volume unmounted): the store waits for it rather
    # than create an empty one where the volume should be.
    state = tmp_path / "volume"
    s = ResponseStore(state / "responses.db", clock=lambda: 1000.0, monotonic=lambda: now[0])
    await s.open()
    try:
        await s.put(rec("a"))
        os.rename(state, tmp_path / "unmounted")
        with pytest.raises(StoreUnavailable):
            await s.get("a")
        now[0] += RETRY_MIN_S
        with pytest.raises(StoreUnavailable):
            await s.get("a")
        assert not state.exists()
        os.rename(tmp_path / "unmounted", state)
        now[0] += 2 * RETRY_MIN_S
        assert (await s.get("a")).id == "a"
    finally:
        await s.close()


async def test_reopening_happens_off_the_event_loop_thread(live, now):
    seen = []
    original = live._reopen

    def spy():
        seen.append(threading.current_thread().name)
        return original()

    live._reopen = spy
    await on_store_thread(live, live._db.close)
    with pytest.raises(StoreUnavailable):
        await live.get("a")
    now[0] += RETRY_MIN_S
    assert (await live.get("a")).id == "a"
    assert seen and seen[0].startswith("store") and seen[0] != threading.current_thread().name


async def test_a_full_disk_keeps_the_store_unavailable_until_a_write_succeeds(live, now,
                                                                             monkeypatch):
    """Opening and reading need no space, so a reopen proves nothing on a full disk: the
    store stayed `available` (and /health `ok`) between writes that each failed with 503.
    SQLite's max_page_count makes the file full, as a full disk does, for every
    connection the store opens."""
    real_connect = sqlite3.connect
    full = {"pages": None}

    def connect(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        if full["pages"] is not None:
            db.execute(f"PRAGMA max_page_count={full['pages']}")
        return db

    monkeypatch.setattr(sqlite3, "connect", connect)

    def fill(db):
        full["pages"] = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count={full['pages']}")

    await on_store_thread(live, fill, live._db)
    big = rec("big", text="x" * 100_000)
    with pytest.raises(StoreUnavailable):
        await live.put(big)
    assert not live.available
    now[0] += RETRY_MIN_S
    assert (await live.get("a")).id == "a"  # reopened: reads are served ...
    assert not live.available               # ... but the disk is still full
    with pytest.raises(StoreUnavailable):
        await live.put(big)
    now[0] += 2 * RETRY_MIN_S
    full["pages"] = None                    # space again
    await live.check()
    await on_store_thread(live, lambda: live._db.execute("PRAGMA max_page_count=1073741823"))
    await live.put(big)
    assert live.available and (await live.get("big")).response == big.response
