"""Responses compaction against the whole app and the fake worker: the sealed item (only
this server's opens: edited, forged and another key's are 400s before any model works),
where an item expands in a prompt, POST /v1/responses/compact's shape, and
`context_management` compacting past its threshold, with the KV cache names it sends and
a chain that continues after it.

The fake worker counts a prompt as its characters (TOKENIZE too) and answers with words,
so a threshold is a number of characters here; what the summary says on a real model is
tests/integration/test_compaction_real.py's.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from protocol import Task
from supervisor.api.responses.items import normalize_input, to_chat_messages
from supervisor.api.responses.seal import KEY_FILE, SUMMARY_HEADER, Sealer, expand
from supervisor.api.responses.summary import SUMMARY_INTRO, SUMMARY_PROMPT
from supervisor.keys import CONFIG
from tests.openresponses.schema import check_event
from tests.schema import validate
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for

LONG = "The parser in utils/dates.py crashes on empty strings; fix it. " * 20  # ~1300 chars


def test_only_this_key_opens_its_items(tmp_path):
    sealer = Sealer.of_state_dir(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / KEY_FILE).st_mode) == 0o600
    item = sealer.item("we fixed a.py", [{"type": "message", "role": "user"}])
    content = item["encrypted_content"]
    assert "a.py" not in content and item["id"].startswith("cmp_")
    assert Sealer.of_state_dir(tmp_path).open(content) == {  # the same key after a restart
        "summary": "we fixed a.py", "kept": [{"type": "message", "role": "user"}],
        "whole": False}
    middle = len(content) // 2
    edited = content[:middle] + ("A" if content[middle] != "A" else "B") + content[middle + 1:]
    assert sealer.open(edited) is None
    assert sealer.open("mlxd1." + content[6:-8] + "AAAAAAAA") is None
    assert sealer.open("gAAAAABpM0Yj-forged=") is None
    assert Sealer("another instance's secret").open(content) is None


@pytest.mark.parametrize("whole,before", [(False, ["first"]), (True, [])])
def test_an_item_expands_in_its_place(whole, before):
    """/compact's item follows the user messages it leaves in the clear; a response's own
    (context_management) stands for everything before it."""
    sealer = Sealer("k")
    kept = normalize_input([{"role": "user", "content": "kept turn"}])
    items = normalize_input([
        {"role": "user", "content": "first"},
        {"type": "compaction", "id": "cmp_1",
         "encrypted_content": sealer.seal("the summary", kept, whole)},
        {"role": "user", "content": "next"}])
    messages = to_chat_messages(expand(items, sealer), "rules")
    assert [m["content"] for m in messages] == [
        "rules", *before, SUMMARY_HEADER + "the summary", "kept turn", "next"]


def _generates(world: FakeWorld, task: Task = Task.GENERATE) -> list:
    return [m for m in world.received if getattr(m, "task", None) is task]


@pytest.fixture
async def app():
    world = FakeWorld(FakeBehaviour(context_length=100_000, tokens=4))
    client = await client_for(world)
    yield client, world
    await client.close()


async def _compact(client, **body) -> dict:
    r = await client.post("/v1/responses/compact", json={"model": "fake", **body})
    assert r.status == 200, await r.text()
    return await r.json()


async def test_compact_answers_openais_shape_and_its_item_continues(app):
    client, world = app
    body = await _compact(client, instructions="be brief", input=[
        {"role": "user", "content": "Fix utils/dates.py"},
        {"type": "message", "role": "assistant", "content": "I changed utils/dates.py."},
        {"role": "user", "content": "Now add a test"}])
    validate(body, "CompactResource")
    assert body["object"] == "response.compaction"
    assert [(o["type"], o.get("role")) for o in body["output"]] == [
        ("message", "user"), ("message", "user"), ("compaction", None)]
    assert body["usage"]["output_tokens"] == 4
    ask = _generates(world)[-1]
    assert len(ask.messages) == 1 and ask.messages[0]["content"].startswith(SUMMARY_INTRO)
    assert "assistant: I changed utils/dates.py." in ask.messages[0]["content"]
    assert ask.cache.keep_as is None and ask.cache.resume_from is None  # a transcript
    # The output, sent back with a new message: the summary stands where the item was.
    r = await client.post("/v1/responses", json={
        "model": "fake", "store": False,
        "input": body["output"] + [{"role": "user", "content": "go on"}]})
    assert r.status == 200, await r.text()
    messages = _generates(world)[-1].messages
    assert [m["content"] for m in messages[:2]] == [
        "Fix utils/dates.py", "Now add a test"]
    summary = messages[2]["content"]
    assert summary.startswith(SUMMARY_HEADER) and "Task: Fix utils/dates.py" in summary
    assert "Files: utils/dates.py" in summary and messages[3]["content"] == "go on"


@pytest.mark.parametrize("change", ["edited", "forged", "foreign"])
async def test_a_compaction_item_not_made_here_is_refused_before_any_work(app, change):
    client, world = app
    content = Sealer.of_state_dir(client.app[CONFIG].state_dir).seal("s")
    if change == "edited":
        content = content[:20] + ("x" if content[20] != "x" else "y") + content[21:]
    elif change == "forged":
        content = "mlxd1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    else:
        content = Sealer("another server's key").seal("s")
    before = len(world.received)
    for path in ("/v1/responses", "/v1/responses/compact"):
        r = await client.post(path, json={"model": "fake", "input": [
            {"type": "compaction", "id": "cmp_x", "encrypted_content": content}]})
        assert r.status == 400, await r.text()
        error = (await r.json())["error"]
        assert error["code"] == "invalid_encrypted_content" and "cmp_x" in error["message"]
    assert len(world.received) == before  # no model read it


async def test_context_management_compacts_past_its_threshold(app):
    client, world = app
    first = {"model": "fake", "prompt_cache_key": "agent", "input": [
        {"role": "user", "content": LONG},
        {"type": "message", "role": "assistant", "content": "Reading it."},
        {"role": "user", "content": "Keep the signature."}],
        "context_management": [{"type": "compaction", "compact_threshold": 1000}]}
    r = await client.post("/v1/responses", json=first)
    assert r.status == 200, await r.text()
    resp = await r.json()
    assert [o["type"] for o in resp["output"]] == ["compaction", "message"]
    assert len(_generates(world, Task.TOKENIZE)) == 1
    summarising, answering = _generates(world)[-2:]
    assert summarising.messages[0]["content"].endswith(SUMMARY_PROMPT)
    # The answer reads the summary, then the turn in progress word for word; the prompt
    # is a new prefix: it resumes from no snapshot and is kept under the response's id.
    assert [m["content"] for m in answering.messages][1:] == ["Keep the signature."]
    assert answering.messages[0]["content"].startswith(SUMMARY_HEADER)
    assert summarising.cache.resume_from is answering.cache.resume_from is None
    assert answering.cache.keep_as == resp["id"] and answering.cache.namespace == "agent"
    # The next turn reads from the compaction item on, and resumes from this response.
    r = await client.post("/v1/responses", json={
        "model": "fake", "previous_response_id": resp["id"], "input": "Done?",
        "context_management": [{"type": "compaction", "compact_threshold": 1000}]})
    assert r.status == 200, await r.text()
    nxt = _generates(world)[-1]
    assert [m["role"] for m in nxt.messages] == ["user", "user", "assistant", "user"]
    assert nxt.messages[0]["content"] == answering.messages[0]["content"]
    assert nxt.messages[-1]["content"] == "Done?"
    assert nxt.cache.resume_from == resp["id"]
    assert len(_generates(world)) == 3  # under the threshold now: no second summary
    # A client that keeps its own history (store: false) and sends all of it, the
    # compaction item included, gets the same prompt.
    r = await client.post("/v1/responses", json={
        "model": "fake", "store": False,
        "input": first["input"] + resp["output"] + [{"role": "user", "content": "Done?"}]})
    assert r.status == 200, await r.text()
    assert _generates(world)[-1].messages == nxt.messages


async def test_under_the_threshold_nothing_is_compacted(app):
    client, world = app
    r = await client.post("/v1/responses", json={
        "model": "fake", "input": "short",
        "context_management": [{"type": "compaction", "compact_threshold": 1000}]})
    assert r.status == 200
    assert [o["type"] for o in (await r.json())["output"]] == ["message"]
    assert len(_generates(world)) == 1


@pytest.mark.parametrize("value,param", [
    ([{"type": "compaction", "compact_threshold": 10}], "context_management[0].compact_threshold"),
    ([{"type": "trim"}], "context_management[0].type"),
    (["compaction"], "context_management[0]"),
])
async def test_bad_context_management_is_a_400(app, value, param):
    client, _ = app
    r = await client.post("/v1/responses", json={"model": "fake", "input": "x",
                                                 "context_management": value})
    assert r.status == 400 and (await r.json())["error"]["param"] == param


async def test_compact_needs_something_to_compact(app):
    client, _ = app
    r = await client.post("/v1/responses/compact", json={"model": "fake"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "input"


async def test_a_compaction_trigger_makes_the_response_the_compaction(app):
    """Codex's remote compaction: its history, then a compaction_trigger, streamed; it
    takes the one compaction item of the output_item.done events and keeps its history's
    user messages before it."""
    client, world = app
    history = [{"role": "user", "content": "Fix utils/dates.py"},
               {"type": "message", "role": "assistant", "content": "Done."}]
    r = await client.post("/v1/responses", json={
        "model": "fake", "store": False, "stream": True,
        "input": history + [{"type": "compaction_trigger"}]})
    assert r.status == 200
    events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["compaction"]
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["output"] == done
    assert final["response"]["usage"]["output_tokens"] == 4
    assert _generates(world)[-1].messages[0]["content"].startswith(SUMMARY_INTRO)
    summary = Sealer.of_state_dir(client.app[CONFIG].state_dir).open(
        done[0]["encrypted_content"])
    assert summary["summary"].startswith("Task: Fix utils/dates.py") and not summary["whole"]
    assert "Notes: " in summary["summary"]
    r = await client.post("/v1/responses", json={"model": "fake", "input": [
        {"type": "compaction_trigger"}, {"role": "user", "content": "x"}]})
    assert r.status == 400 and (await r.json())["error"]["param"] == "input[0].type"


@pytest.fixture
async def slow_app():
    """Each generation takes about a second: long enough to read the stream's first events
    while the summary is still being written."""
    world = FakeWorld(FakeBehaviour(context_length=100_000, tokens=3, step_s=0.3))
    client = await client_for(world)
    yield client, world
    await client.close()


COMPACTING = {"model": "fake", "stream": True, "input": [
    {"role": "user", "content": LONG}, {"role": "user", "content": "Keep the signature."}],
    "context_management": [{"type": "compaction", "compact_threshold": 1000}]}


async def _event(r) -> dict:
    while True:
        line = (await r.content.readline()).decode()
        if line.startswith("data: "):
            return json.loads(line[6:])


async def test_a_streamed_compaction_starts_the_stream_before_the_summary_is_written(slow_app):
    """OpenAI's specification has no event for a compaction in progress, and its item
    needs its encrypted_content: so the response opens at once, the compaction item comes
    whole (added, done) once written, then the answer's items."""
    client, world = slow_app
    r = await client.post("/v1/responses", json=COMPACTING)
    assert r.status == 200
    first = [await _event(r), await _event(r)]
    assert [e["type"] for e in first] == ["response.created", "response.in_progress"]
    assert len(_generates(world)) == 1  # only the summary is asked for so far
    rest = [json.loads(line[6:]) for line in (await r.text()).splitlines()
            if line.startswith("data: ")]
    events = first + rest
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.output_item.done"]
    assert events[2]["item"] == events[3]["item"] and events[3]["item"]["type"] == "compaction"
    assert kinds[4] == "response.output_item.added"
    assert events[4]["item"]["type"] == "message"
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [o["type"] for o in final["output"]] == ["compaction", "message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for ev in events:
        check_event(ev)  # both schemas


async def test_a_client_that_leaves_during_the_summary_cancels_it(slow_app):
    client, world = slow_app
    r = await client.post("/v1/responses", json=COMPACTING)
    assert (await _event(r))["type"] == "response.created"
    rid = (await _event(r))["response"]["id"]
    r.close()  # gone while the summary is written
    for _ in range(100):
        got = await (await client.get(f"/v1/responses/{rid}")).json()
        if got["status"] != "in_progress":
            break
        await asyncio.sleep(0.05)
    assert got["status"] == "cancelled"
    assert len(_generates(world)) == 1  # the answer was never asked for


async def test_a_background_response_compacts_then_answers(app):
    client, world = app
    r = await client.post("/v1/responses", json={**COMPACTING, "stream": False,
                                                 "background": True})
    assert r.status == 200, await r.text()
    rid = (await r.json())["id"]
    for _ in range(200):
        got = await (await client.get(f"/v1/responses/{rid}")).json()
        if got["status"] not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.02)
    assert got["status"] == "completed", got
    assert [o["type"] for o in got["output"]] == ["compaction", "message"]
    summarising, answering = _generates(world)[-2:]
    assert summarising.messages[0]["content"].endswith(SUMMARY_PROMPT)
    assert answering.messages[0]["content"].startswith(SUMMARY_HEADER)
