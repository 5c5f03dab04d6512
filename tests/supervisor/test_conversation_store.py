"""Conversations in the response store's file: items in order, duplicates and the item
limit refused whole, a response's append lenient, bounds by count and age, and a store
written before conversations existed migrated with its responses kept."""

from __future__ import annotations

import sqlite3

import pytest

from supervisor.api.conversations import store as conversations
from supervisor.api.conversations.store import ConversationStore, Duplicate, TooMany
from supervisor.api.responses.store import MIGRATIONS, ResponseStore, StoredResponse


def item(iid: str) -> dict:
    return {"id": iid, "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": iid}], "status": "completed"}


def ids(items) -> list:
    return [i["id"] for i in items]


@pytest.fixture
async def store(tmp_path):
    now = [1000.0]
    s = ResponseStore(tmp_path / "responses.db", clock=lambda: now[0], max_age_s=100,
                      max_count=2)
    s.now = now
    await s.open()
    yield s
    await s.close()


async def test_items_in_order_and_refusals_add_nothing(store, monkeypatch):
    c = ConversationStore(store)
    conv = await c.create({"k": "v"}, [item("a"), item("b")])
    assert await c.add(conv.id, [item("c")])
    with pytest.raises(Duplicate) as e:
        await c.add(conv.id, [item("d"), item("a")])
    assert e.value.item_id == "a"
    monkeypatch.setattr(conversations, "MAX_ITEMS", 4)
    with pytest.raises(TooMany):
        await c.add(conv.id, [item("e"), item("f")])
    assert ids(await c.items(conv.id)) == ["a", "b", "c"]  # neither refusal added anything
    # A finished response's items always land: a held id skipped, the oldest dropped.
    await c.append(conv.id, [item("b"), item("g"), item("h")])
    assert ids(await c.items(conv.id)) == ["b", "c", "g", "h"]
    got = await c.get(conv.id)
    assert (got.metadata, got.item_count) == ({"k": "v"}, 4)
    assert (await c.delete_item(conv.id, "c")).item_count == 3
    assert await c.item(conv.id, "c") is None and (await c.item(conv.id, "g"))["id"] == "g"
    assert await c.add("conv_missing", [item("x")]) is False
    await c.append("conv_missing", [item("x")])  # a deleted conversation: nothing, no error


async def test_bounded_by_count_and_age_items_with_them(store):
    c = ConversationStore(store)
    old = await c.create({}, [item("a")])
    store.now[0] += 1
    used = await c.create({}, [])
    store.now[0] += 1
    await c.set_metadata(old.id, {"touched": "1"})  # use keeps it: `used` is now the oldest
    store.now[0] += 1
    await c.create({}, [])  # the third: one over max_count
    assert await c.get(used.id) is None and await c.get(old.id) is not None
    store.now[0] += 101
    assert await c.get(old.id) is None and await c.items(old.id) is None
    await c.create({}, [])  # eviction runs on create: the aged-out rows go, items too
    db = sqlite3.connect(store.path)
    try:
        assert db.execute("SELECT COUNT(*) FROM conversation_items").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0] == 1
    finally:
        db.close()


async def test_a_store_from_before_conversations_is_migrated(tmp_path):
    path = tmp_path / "responses.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript("BEGIN;" + MIGRATIONS[0] + "PRAGMA user_version=1;COMMIT;")
    db.close()
    s = ResponseStore(path, clock=lambda: 1000.0)
    await s.open()
    try:
        await s.put(StoredResponse("resp_1", 1000.0, "completed", {"id": "resp_1"}, []))
        conv = await ConversationStore(s).create({}, [item("a")])
    finally:
        await s.close()
    s = ResponseStore(path, clock=lambda: 1000.0)  # and again, as after a restart
    await s.open()
    try:
        assert (await s.get("resp_1")).response == {"id": "resp_1"}
        assert ids(await ConversationStore(s).items(conv.id)) == ["a"]
    finally:
        await s.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    db.close()
