"""Conversations and their items, kept in the response store's SQLite file.

The tables are the store's (its migrations create them, api/responses/store.py), and every
read and write goes through the store's `read`/`write`: the same thread, the same checks
for damage and the same 503 while it is down, so a conversation survives a restart exactly
as a stored response does. Bounded like the responses: conversations unused for longer
than the store's age limit are gone, and past its count limit the least recently used
are evicted, items with them. A conversation holds at most MAX_ITEMS items.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from supervisor.api.fields.limits import MAX_MESSAGES
from supervisor.api.responses.items import new_id
from supervisor.api.responses.store import ResponseStore

# A conversation's items become a response's input: no more than a request may send.
MAX_ITEMS = MAX_MESSAGES


@dataclass(frozen=True)
class Conversation:
    id: str
    created_at: float
    metadata: dict
    item_count: int = 0
    last_response: str | None = None  # its latest stored response (a KV snapshot's name)


class Duplicate(Exception):
    """An item whose id the conversation already holds."""

    def __init__(self, item_id: str):
        super().__init__(item_id)
        self.item_id = item_id


class TooMany(Exception):
    """Adding the items would pass MAX_ITEMS."""


class ConversationStore:
    def __init__(self, store: ResponseStore):
        self.store = store

    async def create(self, metadata: dict, items: list[dict]) -> Conversation:
        return await self.store.write(self._create, metadata, items)

    def _create(self, db: sqlite3.Connection, now: float, metadata: dict, items: list):
        conv = Conversation(new_id("conv"), now, metadata)
        db.execute("INSERT INTO conversations (id, created_at, updated_at, metadata) "
                   "VALUES (?, ?, ?, ?)",
                   (conv.id, now, now, json.dumps(metadata)))
        self._insert(db, conv.id, items, strict=True)
        self._evict(db, now)
        return conv

    async def get(self, cid: str) -> Conversation | None:
        return await self.store.read(self._get, cid)

    def _get(self, db: sqlite3.Connection, now: float, cid: str) -> Conversation | None:
        row = db.execute("SELECT id, created_at, metadata, last_response_id "
                         "FROM conversations "
                         "WHERE id=? AND updated_at >= ?",
                         (cid, now - self.store.max_age_s)).fetchone()
        if row is None:
            return None
        count = db.execute("SELECT COUNT(*) FROM conversation_items WHERE conversation_id=?",
                           (cid,)).fetchone()[0]
        return Conversation(row[0], row[1], json.loads(row[2]), count, row[3])

    async def set_metadata(self, cid: str, metadata: dict) -> Conversation | None:
        def update(db, now):
            if self._get(db, now, cid) is None:
                return None
            db.execute("UPDATE conversations SET metadata=?, updated_at=? WHERE id=?",
                       (json.dumps(metadata), now, cid))
            return self._get(db, now, cid)
        return await self.store.write(update)

    async def delete(self, cid: str) -> bool:
        def delete(db, now):
            if self._get(db, now, cid) is None:
                return False
            self._drop(db, "id=?", (cid,))
            return True
        return await self.store.write(delete)

    async def items(self, cid: str) -> list[dict] | None:
        """Every item, oldest first; None when there is no such conversation."""
        def items(db, now):
            if self._get(db, now, cid) is None:
                return None
            rows = db.execute("SELECT item FROM conversation_items WHERE conversation_id=? "
                              "ORDER BY seq", (cid,)).fetchall()
            return [json.loads(r[0]) for r in rows]
        return await self.store.read(items)

    async def add(self, cid: str, items: list[dict]) -> bool:
        """Append items; False when there is no such conversation. Raises Duplicate and
        TooMany (nothing added)."""
        def add(db, now):
            if self._get(db, now, cid) is None:
                return False
            self._insert(db, cid, items, strict=True)
            db.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, cid))
            return True
        return await self.store.write(add)

    async def append(self, cid: str, items: list[dict], response_id: str | None = None) -> None:
        """A finished response's items: nothing when the conversation is gone, items it
        already holds skipped, and the oldest items dropped past MAX_ITEMS (the response
        ran; losing its record because of a limit would be worse). `response_id`: the
        response when it is stored (else None): the next turn resumes from its KV snapshot."""
        def append(db, now):
            if self._get(db, now, cid) is not None:
                self._insert(db, cid, items, strict=False)
                db.execute("UPDATE conversations SET updated_at=?, last_response_id=? "
                           "WHERE id=?", (now, response_id, cid))
        await self.store.write(append)

    async def item(self, cid: str, item_id: str) -> dict | None:
        def item(db, now):
            if self._get(db, now, cid) is None:
                return None
            row = db.execute("SELECT item FROM conversation_items WHERE conversation_id=? "
                             "AND id=?", (cid, item_id)).fetchone()
            return None if row is None else json.loads(row[0])
        return await self.store.read(item)

    async def delete_item(self, cid: str, item_id: str) -> Conversation | None:
        """The conversation after the deletion; None when it or the item is missing."""
        def delete(db, now):
            if self._get(db, now, cid) is None:
                return None
            if not db.execute("DELETE FROM conversation_items WHERE conversation_id=? AND id=?",
                              (cid, item_id)).rowcount:
                return None
            db.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, cid))
            return self._get(db, now, cid)
        return await self.store.write(delete)

    # ---- on the store thread ---------------------------------------------------------
    @staticmethod
    def _insert(db: sqlite3.Connection, cid: str, items: list, strict: bool) -> None:
        verb = "INSERT" if strict else "INSERT OR IGNORE"
        for item in items:
            try:
                db.execute(f"{verb} INTO conversation_items (conversation_id, id, item) "
                           "VALUES (?, ?, ?)", (cid, item["id"], json.dumps(item)))
            except sqlite3.IntegrityError:
                raise Duplicate(item["id"]) from None
        count = db.execute("SELECT COUNT(*) FROM conversation_items WHERE conversation_id=?",
                           (cid,)).fetchone()[0]
        if count <= MAX_ITEMS:
            return
        if strict:
            raise TooMany(count)
        db.execute("DELETE FROM conversation_items WHERE seq IN (SELECT seq FROM "
                   "conversation_items WHERE conversation_id=? ORDER BY seq LIMIT ?)",
                   (cid, count - MAX_ITEMS))

    def _evict(self, db: sqlite3.Connection, now: float) -> None:
        self._drop(db, "updated_at < ?", (now - self.store.max_age_s,))
        self._drop(db, "id IN (SELECT id FROM conversations ORDER BY updated_at DESC "
                   "LIMIT -1 OFFSET ?)", (self.store.max_count,))

    @staticmethod
    def _drop(db: sqlite3.Connection, where: str, args: tuple) -> None:
        """Delete the conversations matching `where`, with their items."""
        db.execute("DELETE FROM conversation_items WHERE conversation_id IN "
                   f"(SELECT id FROM conversations WHERE {where})", args)
        db.execute(f"DELETE FROM conversations WHERE {where}", args)
