"""Responses stored before a field existed read back complete: a row in the format an
earlier mlxd wrote (no presence_penalty, frequency_penalty, top_logprobs, service_tier,
max_tool_calls, safety_identifier; no usage on a response that did not complete; a tool
without a description) is put into the store's file, and the API answers it, as an
object and replayed as events, valid under OpenAI's and the Open Responses schemas, and
a new response continues from it."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from pathlib import Path

from supervisor.api.responses.builder import ResponseBuilder
from supervisor.api.responses.request import parse_responses_request
from supervisor.api.responses.store import MIGRATIONS, RESPONSE_DEFAULTS
from tests.openresponses.schema import check_event, check_response
from tests.supervisor.fakes import FakeWorld
from tests.supervisor.test_app import client_for

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def old_row(rid: str) -> dict:
    """A failed response as the store held it before those fields were added."""
    b = ResponseBuilder(parse_responses_request({"model": "fake", "input": "hi",
                                                 "tools": [TOOL]}), "fake", id=rid)
    b.start()
    b.text("Hel")
    b.finish("failed", error={"code": "server_error", "message": "worker died; retry"})
    obj = b.response()
    for key in RESPONSE_DEFAULTS:
        obj.pop(key)
    obj["tools"] = [{k: v for k, v in t.items() if k != "description"} for t in obj["tools"]]
    return obj


def write_store(state_dir: Path, obj: dict) -> None:
    db = sqlite3.connect(state_dir / "responses.db", isolation_level=None)
    for i, step in enumerate(MIGRATIONS):
        db.executescript("BEGIN;" + step + f"PRAGMA user_version={i + 1};COMMIT;")
    items = [{"id": "msg_in", "type": "message", "role": "user", "status": "completed",
              "content": [{"type": "input_text", "text": "hi"}]}]
    db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)",
               (obj["id"], obj["created_at"], obj["status"], None, json.dumps(obj),
                json.dumps(items)))
    db.close()


async def test_an_old_row_reads_back_complete_and_continues():
    state_dir = Path(tempfile.mkdtemp(prefix="mlxd-old-"))
    write_store(state_dir, old_row("resp_old"))
    world = FakeWorld()
    client = await client_for(world, state_dir=state_dir)
    try:
        r = await client.get("/v1/responses/resp_old")
        assert r.status == 200, await r.text()
        got = await r.json()
        check_response(got)
        assert {k: got[k] for k in RESPONSE_DEFAULTS} == RESPONSE_DEFAULTS
        assert got["tools"][0]["description"] is None
        r = await client.get("/v1/responses/resp_old?stream=true")
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: ")]
        assert events and events[-1]["type"] == "response.failed"
        for ev in events:
            check_event(ev)
        r = await client.post("/v1/responses", json={
            "model": "fake", "previous_response_id": "resp_old", "input": "again"})
        assert r.status == 200, await r.text()
        check_response(await r.json())
    finally:
        await client.close()
