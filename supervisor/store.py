"""The response store: stored Responses API objects and their replayable conversations.

SQLite in WAL mode in the state directory (file mode 0600), so responses survive a
supervisor restart. One row per response: the response object as the API returns it and
the input items of its turn; `previous_response_id` chains rebuild the conversation from
those rows (depth-limited, cycle-checked). Bounded by count and age, oldest evicted first.
Schema versioned through `PRAGMA user_version` and a list of migrations.

All SQLite work runs on one dedicated thread that owns the connection: the event loop
never blocks on disk, and sqlite3 objects never cross threads.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

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
]

# Statuses of a response still being generated: a restart leaves them orphaned.
UNFINISHED = ("queued", "in_progress")


class ChainError(Exception):
    """A previous_response_id chain that cannot be rebuilt."""

    def __init__(self, message: str, missing_id: str | None = None):
        super().__init__(message)
        self.missing_id = missing_id


@dataclass
class StoredResponse:
    id: str
    created_at: float
    status: str
    response: dict                   # the object as GET /v1/responses/{id} returns it
    input_items: list = field(default_factory=list)  # this turn's input items, with ids
    previous_response_id: str | None = None


class ResponseStore:
    def __init__(self, path: Path, *, max_count: int = 10_000, max_age_s: float = 30 * 86400,
                 clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._clock = clock
        self._db: sqlite3.Connection | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- lifecycle -------------------------------------------------------------------
    async def open(self) -> int:
        """Open (creating and migrating as needed); returns how many unfinished responses
        a previous run left behind and were marked failed."""
        return await self._run(self._open)

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # created private
        os.close(fd)
        os.chmod(self.path, 0o600)
        db = sqlite3.connect(self.path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across crashes of us
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise RuntimeError(f"{self.path} has schema version {version}, newer than this "
                               f"mlxd ({len(MIGRATIONS)}); upgrade mlxd or use another --state-dir")
        for i in range(version, len(MIGRATIONS)):
            with db:
                db.executescript("BEGIN;" + MIGRATIONS[i] + f"PRAGMA user_version={i + 1};COMMIT;")
        for suffix in ("-wal", "-shm"):
            side = Path(str(self.path) + suffix)
            if side.exists():
                os.chmod(side, 0o600)
        self._db = db
        return self._fail_unfinished()

    def _fail_unfinished(self) -> int:
        """A response in progress when the previous supervisor stopped is failed, never
        silently lost: its generation died with that process."""
        rows = self._db.execute(
            f"SELECT id, response FROM responses WHERE status IN ({','.join('?' * len(UNFINISHED))})",
            UNFINISHED).fetchall()
        for rid, raw in rows:
            obj = json.loads(raw)
            obj["status"] = "failed"
            obj["error"] = {"code": "server_error",
                            "message": "The server restarted while this response was being generated."}
            self._db.execute("UPDATE responses SET status='failed', response=? WHERE id=?",
                             (json.dumps(obj), rid))
        return len(rows)

    async def close(self) -> None:
        def _close():
            if self._db is not None:
                self._db.close()
                self._db = None
        await self._run(_close)
        self._pool.shutdown(wait=True)

    # ---- records ---------------------------------------------------------------------
    async def put(self, rec: StoredResponse) -> None:
        await self._run(self._put, rec)

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
        return await self._run(_update)

    async def get(self, rid: str) -> StoredResponse | None:
        return await self._run(self._get, rid)

    def _get(self, rid: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT id, created_at, status, response, input_items, previous_response_id "
            "FROM responses WHERE id=? AND created_at >= ?",
            (rid, self._clock() - self.max_age_s)).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]), row[5])

    async def delete(self, rid: str) -> bool:
        def _delete():
            with self._db:
                return self._db.execute("DELETE FROM responses WHERE id=?", (rid,)).rowcount > 0
        return await self._run(_delete)

    async def count(self) -> int:
        return await self._run(lambda: self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

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
        return await self._run(_chain)
