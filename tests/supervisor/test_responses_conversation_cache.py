"""A conversation's next response resumes from its latest stored response's KV snapshot,
as a `previous_response_id` turn does: the Generate the fake worker receives names it
(`cache.resume_from`), a stored turn keeps its state under its own id, a turn that is
not stored leaves nothing to resume from, and a failed turn does not move the point.
The tokens it saves on a real model: tests/integration/test_conversations.py."""

from __future__ import annotations

import pytest

from protocol import Task
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for


@pytest.fixture
async def app():
    world = FakeWorld(FakeBehaviour(tokens=3))
    client = await client_for(world)
    yield client, world
    await client.close()


def last_generate(world: FakeWorld):
    return [m for m in world.received if getattr(m, "task", None) is Task.GENERATE][-1]


async def turn(client, cid: str, text: str, **kw) -> dict:
    r = await client.post("/v1/responses", json={"model": "fake", "conversation": cid,
                                                  "input": text, **kw})
    assert r.status == 200, await r.text()
    return await r.json()


async def test_each_turn_resumes_from_the_last_stored_one(app):
    client, world = app
    r = await client.post("/v1/conversations", json={})
    cid = (await r.json())["id"]
    first = await turn(client, cid, "one")
    cache = last_generate(world).cache
    assert cache.resume_from is None and cache.keep_as == first["id"]
    second = await turn(client, cid, "two")
    cache = last_generate(world).cache
    assert cache.resume_from == first["id"] and cache.keep_as == second["id"]
    assert cache.resume_label == first["id"]
    # Items added through the Conversations API come after the state: it still begins
    # the prompt, so the next turn still resumes from it.
    r = await client.post(f"/v1/conversations/{cid}/items",
                          json={"items": [{"role": "user", "content": "note"}]})
    assert r.status == 200
    await turn(client, cid, "three", store=False)
    cache = last_generate(world).cache
    assert cache.resume_from == second["id"] and cache.keep_as is None
    # That turn kept no state under a name: the next starts from prefix matching only.
    await turn(client, cid, "four")
    assert last_generate(world).cache.resume_from is None
