"""The response store: stored Responses API objects and their replayable conversations,
and the tables of the Conversations API (api/conversations/store.py reads and writes them
through `read`/`write`, so they share this file's thread, checks and recovery).

SQLite in WAL mode in the state directory (file mode 0600), so responses survive a
supervisor restart. One row per response: the response object as the API returns it and
the input items of its turn; `previous_response_id` chains rebuild the conversation from
those rows (depth-limited, cycle-checked). Bounded by count and age, oldest evicted first.
Schema versioned through `PRAGMA user_version` and a list of migrations.

All SQLite work runs on one dedicated thread that owns the connection: the event loop
never blocks on disk, and sqlite3 objects never cross threads.

The store is an accessory to generation, so damage to it never stops the server:

- Damaged at open (a file that is not a database, a truncated one, pages of garbage:
  SQLite's CORRUPT/NOTADB, or `PRAGMA quick_check` finding faults). The check opens the
  file read-only, so neither it nor its `-wal` is written (only `-shm`, the index SQLite
  rebuilds from the `-wal` on any read, may be); then the file and its side files are
  renamed aside to `responses.db.corrupt-<UTC time>` (+ `-wal`/`-shm`, the names SQLite
  looks for, so the copy opens as it was), kept for the operator, and an empty store is
  created. One log line names both paths. A file that passes the check is never touched.
- A schema newer than this mlxd is not damage: a newer mlxd wrote that healthy file.
  `open()` raises `SchemaTooNew` and the server refuses to start (routes.py): moving it
  aside would hide the data from the mlxd that owns it, and serving without it would
  turn every stored response into an error with nobody told why. Only the operator can
  decide (upgrade mlxd, or use another --state-dir), and start is when one is watching.
- Failing mid-run (any sqlite3 error: disk I/O error, disk full, malformed image, a
  closed connection; or the file deleted or replaced underneath, seen by comparing its
  inode before each operation): the connection is dropped and every call raises
  `StoreUnavailable` (routes answer 503) without touching the disk until a retry is due.
  The first call after that reopens the store through the same checks as at start (so a
  file that turned out damaged is moved aside, a deleted one is created empty, a file put
  back is used again). A failed retry doubles the wait, from RETRY_MIN_S up to
  RETRY_MAX_S, so a sick disk is not hammered; a success resets it.
- Failing at start for a reason that is not damage (permissions, a disk error, a lock
  held too long): the server starts anyway, with the store unavailable and retrying as
  above. Only damage is ever moved aside.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

log = logging.getLogger("mlxd.store")

# Index i holds the step from schema version i to i + 1. Append; never edit a shipped one.
MIGRATIONS = [
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        status TEXT NOT NULL,
        previous_response_id TEXT,
        response TEXT NOT NULL,
        input_items TEXT NOT NULL
    );
    CREATE INDEX responses_by_age ON responses (created_at);
    """,
    # Conversations (api/conversations/store.py): items in the order they were added.
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        metadata TEXT NOT NULL
    );
    CREATE INDEX conversations_by_use ON conversations (updated_at);
    CREATE TABLE conversation_items (
        seq INTEGER PRIMARY KEY,
        conversation_id TEXT NOT NULL,
        id TEXT NOT NULL,
        item TEXT NOT NULL,
        UNIQUE (conversation_id, id)
    );
    """,
    # A conversation's latest stored response: its KV snapshot is where the next turn
    # resumes (api/conversations/turns.py).
    """
    ALTER TABLE conversations ADD COLUMN last_response_id TEXT;
    """,
]

# The fields a Response gained after rows were written (its JSON has no schema of its
# own): a row read back gets each one's default, as the response would have had it when
# it was written, so a stored response always reads as complete as a new one.
RESPONSE_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0,
                     "service_tier": "default", "max_tool_calls": None,
                     "safety_identifier": None, "usage": None}


def completed(response: dict) -> dict:
    """A stored response with the defaults of the fields it was written without (a
    Response object's: a row holding anything else is returned as it is)."""
    if response.get("object") != "response":
        return response
    for key, value in RESPONSE_DEFAULTS.items():
        response.setdefault(key, value)
    for tool in response.get("tools") or []:
        if isinstance(tool, dict) and tool.get("type") == "function":
            tool.setdefault("description", None)  # may be null, never absent
    return response


# Statuses of a response still being generated: a restart leaves them orphaned.
UNFINISHED = ("queued", "in_progress")

# Seconds between reopen attempts after a failure: doubling from MIN to MAX.
RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0

# SQLite's primary result codes that mean the file's content is damaged (extended codes,
# e.g. SQLITE_CORRUPT_INDEX, share the low byte).
_DAMAGE_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
_SIDE_FILES = ("-wal", "-shm")


class ChainError(Exception):
    """A previous_response_id chain that cannot be rebuilt."""

    def __init__(self, message: str, missing_id: str | None = None):
        super().__init__(message)
        self.missing_id = missing_id


class SchemaTooNew(RuntimeError):
    """The store was written by a newer mlxd: healthy, but not ours to read or change."""


class StoreUnavailable(Exception):
    """The store failed and has not come back yet; `retry_after` seconds until it next
    tries. The message is safe to show a client."""

    def __init__(self, retry_after: float):
        super().__init__("The response store is unavailable, so stored responses cannot be "
                         "read or written right now; the server is trying to reopen it. "
                         "Generation without storage (`store: false`) still works.")
        self.retry_after = retry_after


@dataclass
class StoredResponse:
    id: str
    created_at: float
    status: str
    response: dict                   # the object as GET /v1/responses/{id} returns it
    input_items: list = field(default_factory=list)  # this turn's input items, with ids
    previous_response_id: str | None = None


def is_damage(e: BaseException) -> bool:
    """True for SQLite's own verdict that a file's content is damaged (not an I/O error,
    a lock, a permission or a full disk, which say nothing about the content)."""
    code = getattr(e, "sqlite_errorcode", None)
    return (isinstance(e, sqlite3.DatabaseError) and code is not None
            and (code & 0xFF) in _DAMAGE_CODES)


def describe(e: BaseException) -> str:
    """An error in words fit for the log. SQLite's own messages name no data; the sqlite3
    module's may quote a row (a failed text decode), so those are named by class only."""
    if isinstance(e, sqlite3.Error):
        name = getattr(e, "sqlite_errorname", None)
        return f"{name}: {e}" if name else type(e).__name__
    return f"{type(e).__name__}: {e}"


class ResponseStore:
    def __init__(self, path: Path, *, max_count: int = 10_000, max_age_s: float = 30 * 86400,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._clock = clock
        self._monotonic = monotonic     # for the retry schedule
        self._db: sqlite3.Connection | None = None
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._failures = 0              # consecutive failures; 0 = healthy
        self._orphans_failed = False    # _fail_unfinished done (once, at the first open)
        self._retry_at = 0.0            # monotonic time of the next reopen attempt
        # The last write failed and none has succeeded since: a reopen alone proves
        # nothing on a full disk (opening and reading need no space; the next write fails).
        self._write_failed = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _guarded(self, fn, *args):
        return await self._run(self._guard, fn, False, *args)

    async def _written(self, fn, *args):
        """_guarded for a write: its outcome decides whether the store is `available`."""
        return await self._run(self._guard, fn, True, *args)

    @property
    def available(self) -> bool:
        """Open, and its last write (if the last one failed) succeeded since."""
        return self._failures == 0 and not self._write_failed

    # ---- lifecycle -------------------------------------------------------------------
    async def open(self) -> int:
        """Open (creating, migrating, and moving a damaged file aside as needed); returns
        how many unfinished responses a previous run left behind and were marked failed.
        Raises SchemaTooNew; any other failure leaves the store unavailable and retrying."""
        return await self._run(self._open)

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._reopen()
            return self._fail_unfinished()
        except SchemaTooNew:
            self._drop()
            raise
        except (sqlite3.Error, OSError) as e:
            self._failed(e)
            return 0

    def _reopen(self) -> None:
        """Close whatever is open, check the file, move it aside if damaged, open it."""
        self._drop()
        removed = self._file_id is not None and not os.path.lexists(self.path)
        reason = self._damage()
        if reason is not None:
            self._move_aside(reason)
        try:
            self._connect()
        except sqlite3.DatabaseError as e:  # damage the read-only check could not see
            if not is_damage(e):
                raise
            self._drop()
            self._move_aside(describe(e))
            self._connect()
        if removed:
            log.warning("response store %s was removed while in use: started an empty one",
                        self.path)

    def _damage(self) -> str | None:
        """Why the file is damaged, or None: healthy, empty or missing. Read-only, so a
        damaged file is moved aside with the bytes it had. Raises SchemaTooNew, and the
        errors that are not damage (I/O, locks, permissions)."""
        try:
            if self.path.stat().st_size == 0:
                return None
        except FileNotFoundError:
            return None
        uri = Path(os.path.abspath(self.path)).as_uri() + "?mode=ro"
        db = sqlite3.connect(uri, uri=True, isolation_level=None)
        try:
            self._check_version(db)
            faults = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
        except sqlite3.DatabaseError as e:
            if is_damage(e):
                return describe(e)
            if (getattr(e, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_READONLY:
                # A hot journal or WAL only a writer can replay: not damage; the writable
                # open replays it, and damage it then meets is still caught (_reopen).
                return None
            raise
        finally:
            db.close()
        if faults != ["ok"]:
            return "quick_check: " + "; ".join(faults[:3])
        return None

    def _check_version(self, db: sqlite3.Connection) -> int:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise SchemaTooNew(f"{self.path} has schema version {version}, newer than this "
                               f"mlxd ({len(MIGRATIONS)}); upgrade mlxd or use another --state-dir")
        return version

    def _move_aside(self, reason: str) -> None:
        """Rename the damaged file and its side files to a free `.corrupt-<UTC>` name."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        base, n = f"{self.path}.corrupt-{stamp}", 1
        aside = base
        while any(os.path.lexists(aside + s) for s in ("", *_SIDE_FILES)):
            n += 1
            aside = f"{base}.{n}"
        for suffix in ("", *_SIDE_FILES):
            if os.path.lexists(f"{self.path}{suffix}"):
                os.rename(f"{self.path}{suffix}", aside + suffix)
        log.error("response store %s is damaged (%s): moved it aside to %s (with its -wal/-shm "
                  "files, if any) and started an empty store", self.path, reason, aside)

    def _connect(self) -> None:
        if not self.path.parent.is_dir():  # e.g. a volume not mounted: do not invent it
            raise FileNotFoundError(f"{self.path.parent} does not exist")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # created private
        os.close(fd)
        os.chmod(self.path, 0o600)
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across crashes of us
            version = self._check_version(db)
            for i in range(version, len(MIGRATIONS)):
                with db:
                    db.executescript("BEGIN;" + MIGRATIONS[i] + f"PRAGMA user_version={i + 1};COMMIT;")
            for suffix in _SIDE_FILES:
                side = Path(str(self.path) + suffix)
                if side.exists():
                    os.chmod(side, 0o600)
            st = os.stat(self.path)
        except BaseException:
            db.close()
            raise
        self._db, self._file_id = db, (st.st_dev, st.st_ino)

    def _drop(self) -> None:
        """Forget the connection (closing it if it still closes)."""
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass

    def _fail_unfinished(self) -> int:
        """A response in progress when the previous supervisor stopped is failed, never
        silently lost: its generation died with that process. Done at the first open that
        succeeds, before this process can have stored anything in progress itself."""
        rows = self._db.execute(
            f"SELECT id, response FROM responses WHERE status IN ({','.join('?' * len(UNFINISHED))})",
            UNFINISHED).fetchall()
        for rid, raw in rows:
            try:
                obj = json.loads(raw)
            except ValueError:  # an unreadable row still ends failed, with what is known
                obj = {"id": rid, "object": "response"}
            obj["status"] = "failed"
            obj["error"] = {"code": "server_error",
                            "message": "The server restarted while this response was being generated."}
            self._db.execute("UPDATE responses SET status='failed', response=? WHERE id=?",
                             (json.dumps(obj), rid))
        self._orphans_failed = True
        return len(rows)

    async def close(self) -> None:
        await self._run(self._drop)
        self._pool.shutdown(wait=True)

    # ---- failure and recovery (on the store thread) ----------------------------------
    def _guard(self, fn, write: bool, *args):
        """Run `fn` against a healthy connection, or raise StoreUnavailable: reopening
        first when a retry is due, and marking the store failed when `fn` fails."""
        if self._db is None:
            self._recover()
        try:
            self._same_file()
            result = fn(*args)
        except (sqlite3.Error, OSError) as e:
            self._write_failed |= write
            self._failed(e)
            raise StoreUnavailable(self._retry_at - self._monotonic()) from None
        if write and self._write_failed:
            self._write_failed = False
            log.warning("response store %s takes writes again", self.path)
        return result

    def _same_file(self) -> None:
        """SQLite keeps writing to a file deleted or replaced underneath it, where nothing
        would ever read it again: compare what is at the path with what we opened."""
        st = os.stat(self.path)  # FileNotFoundError if deleted
        if (st.st_dev, st.st_ino) != self._file_id:
            raise FileNotFoundError(f"{self.path} was replaced by another file")

    def _recover(self) -> None:
        wait = self._retry_at - self._monotonic()
        if wait > 0:
            raise StoreUnavailable(wait)
        try:
            self._reopen()
            orphans = 0 if self._orphans_failed else self._fail_unfinished()
        except (sqlite3.Error, OSError, SchemaTooNew) as e:
            self._failed(e)
            raise StoreUnavailable(self._retry_at - self._monotonic()) from None
        log.warning("response store %s is available again", self.path)
        if orphans:
            log.warning("%d responses were in progress when the server last stopped; "
                        "marked failed", orphans)
        self._failures = 0

    def _failed(self, e: BaseException) -> None:
        self._drop()
        self._failures += 1
        delay = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** (self._failures - 1))
        self._retry_at = self._monotonic() + delay
        # One line when it breaks; the retries that fail again are quieter.
        level = logging.ERROR if self._failures == 1 else logging.INFO
        log.log(level, "response store %s is unavailable (%s): stored responses answer 503 "
                "until it reopens; next try in %gs", self.path, describe(e), delay)

    # ---- other tables in this file (api/conversations/store.py) ----------------------
    async def read(self, fn, *args):
        """fn(connection, now, *args) on the store thread, guarded as every read here."""
        return await self._guarded(lambda: fn(self._db, self._clock(), *args))

    async def write(self, fn, *args):
        """read() for a write, in one transaction: all of it or, when `fn` raises,
        nothing (the connection autocommits, so the transaction is begun here)."""
        def tx():
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(db, self._clock(), *args)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return result
        return await self._written(tx)

    # ---- records ---------------------------------------------------------------------
    async def check(self) -> None:
        """Raise StoreUnavailable unless the store can be used now (reopening it if due)."""
        await self._guarded(lambda: None)

    async def put(self, rec: StoredResponse) -> None:
        await self._written(self._put, rec)

    def _put(self, rec: StoredResponse) -> None:
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (rec.id, rec.created_at, rec.status, rec.previous_response_id,
                 json.dumps(rec.response), json.dumps(rec.input_items)))
            self._evict()

    def _evict(self) -> None:
        self._db.execute("DELETE FROM responses WHERE created_at < ?",
                         (self._clock() - self.max_age_s,))
        self._db.execute(
            "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
            "ORDER BY created_at DESC LIMIT -1 OFFSET ?)", (self.max_count,))

    async def update(self, rid: str, status: str, response: dict) -> bool:
        """Replace a stored response object (generation finished, cancelled...)."""
        def _update():
            with self._db:
                cur = self._db.execute("UPDATE responses SET status=?, response=? WHERE id=?",
                                       (status, json.dumps(response), rid))
            return cur.rowcount > 0
        return await self._written(_update)

    async def get(self, rid: str) -> StoredResponse | None:
        return await self._guarded(self._get, rid)

    def _get(self, rid: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT id, created_at, status, response, input_items, previous_response_id "
            "FROM responses WHERE id=? AND created_at >= ?",
            (rid, self._clock() - self.max_age_s)).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], completed(json.loads(row[3])),
                              json.loads(row[4]), row[5])

    async def delete(self, rid: str) -> bool:
        def _delete():
            with self._db:
                return self._db.execute("DELETE FROM responses WHERE id=?", (rid,)).rowcount > 0
        return await self._written(_delete)

    async def count(self) -> int:
        return await self._guarded(
            lambda: self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    async def chain(self, rid: str, max_depth: int) -> list[StoredResponse]:
        """`rid` and its ancestors, oldest first. ChainError if one is missing (deleted,
        evicted, never stored), the chain loops, or it is deeper than `max_depth`."""
        def _chain():
            out, seen, cur = [], set(), rid
            while cur is not None:
                if cur in seen:
                    raise ChainError(f"previous_response_id chain loops at {cur}")
                if len(out) >= max_depth:
                    raise ChainError(f"previous_response_id chain is deeper than {max_depth} responses")
                seen.add(cur)
                rec = self._get(cur)
                if rec is None:
                    raise ChainError(f"Previous response with id '{cur}' not found.", cur)
                out.append(rec)
                cur = rec.previous_response_id
            out.reverse()
            return out
        return await self._guarded(_chain)
