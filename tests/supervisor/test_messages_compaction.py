"""Anthropic's compaction request (supervisor/api/messages/compaction.py): what it takes,
and the conversation as the summary reads it; over HTTP against the fake worker, the
message and its stream are one compaction block, stop_reason "compaction"."""

from __future__ import annotations

import pytest

from supervisor.api.messages.compaction import items_of, parse
from supervisor.http.errors import APIError
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for
from tests.supervisor.test_messages_routes import events_of


def test_what_a_compaction_request_takes():
    assert parse({}) is None
    assert parse({"compaction": {"type": "summarize"}}) == ""
    assert parse({"compaction": {"type": "summarize", "instructions": "Keep paths."}}) == \
        "Keep paths."
    for value, param in (("yes", "compaction"), ({}, "compaction.type"),
                         ({"type": "drop"}, "compaction.type"),
                         ({"type": "summarize", "instructions": 3}, "compaction.instructions")):
        with pytest.raises(APIError) as e:
            parse({"compaction": value})
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(APIError) as e:   # one or the other, as Anthropic's API says
        parse({"compaction": {"type": "summarize"}, "context_management": {"edits": []}})
    assert e.value.param == "compaction"


def test_the_summary_reads_the_conversation_as_items():
    messages = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Fix src/app.py"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "def main(): ..."},
    )
    assert [(i["type"], i.get("role")) for i in items_of(messages)] == [
        ("message", "system"), ("message", "user"), ("message", "assistant"),
        ("function_call", None), ("function_call_output", None)]
    assert items_of(messages)[4]["output"] == "def main(): ..."


@pytest.mark.parametrize("stream", [False, True])
async def test_over_http_the_answer_is_one_compaction_block(stream):
    client = await client_for(FakeWorld(FakeBehaviour(tokens=3, context_length=4096)))
    try:
        r = await client.post("/v1/messages", json={
            "model": "fake", "max_tokens": 50, "stream": stream,
            "compaction": {"type": "summarize"},
            "messages": [{"role": "user", "content": "Fix src/app.py"},
                         {"role": "assistant", "content": "Done."}]})
        assert r.status == 200
        if stream:
            events = events_of(await r.text())
            assert [n for n, _ in events] == ["message_start", "content_block_start",
                                              "content_block_delta", "content_block_stop",
                                              "message_delta", "message_stop"]
            assert events[1][1]["content_block"]["type"] == "compaction"
            content = events[2][1]["delta"]["content"]
            assert events[2][1]["delta"]["type"] == "compaction_delta"
            assert events[4][1]["delta"]["stop_reason"] == "compaction"
        else:
            body = await r.json()
            [block] = body["content"]
            assert body["stop_reason"] == "compaction" and block["type"] == "compaction"
            assert block["signature"]
            content = block["content"]
        assert content.startswith("Task: Fix src/app.py") and "Files: src/app.py" in content
    finally:
        await client.close()
