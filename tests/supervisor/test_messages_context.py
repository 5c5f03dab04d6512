"""Context editing (api/messages/context.py) on the chat-form messages, with a stand-in
token count (characters): which tool results and thinking go, what stays, the triggers,
and edits this server does not do skipped rather than refused."""

from __future__ import annotations

import json

import pytest

from supervisor.api.messages import context
from supervisor.api.messages.request import parse_messages_request
from supervisor.http.errors import APIError


def _history(uses: int) -> dict:
    messages = [{"role": "user", "content": "go"}]
    for i in range(uses):
        name = "keep_me" if i == 0 else "read"
        messages += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"plan {i}", "signature": "s"},
                {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"n": i}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"t{i}", "content": "x" * 500}]}]
    return {"model": "m", "max_tokens": 10, "messages": messages}


async def _count(messages: tuple) -> int:
    return len(json.dumps(messages))


async def _apply(body: dict, edits: list):
    parsed = parse_messages_request(body)
    return await context.apply(parsed, context.parse({"edits": edits}), _count)


def _results(parsed) -> dict:
    return {m["tool_call_id"]: m["content"] for m in parsed.messages if m["role"] == "tool"}


async def test_old_tool_results_are_cleared_but_the_last_and_the_excluded():
    edit = {"type": context.TOOL_USES, "trigger": {"type": "input_tokens", "value": 100},
            "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["keep_me"],
            "clear_tool_inputs": True}
    parsed, applied = await _apply(_history(5), [edit])
    results = _results(parsed)
    assert results["t0"] == "x" * 500  # excluded
    assert results["t1"] == results["t2"] == context.CLEARED
    assert results["t3"] == results["t4"] == "x" * 500  # the last two
    calls = {c["id"]: c["function"]["arguments"] for m in parsed.messages
             for c in m.get("tool_calls") or ()}
    assert calls["t1"] == "{}" and calls["t3"] == '{"n": 3}'
    [done] = applied
    assert done["type"] == context.TOOL_USES and done["cleared_tool_uses"] == 2
    before = await _count(parse_messages_request(_history(5)).messages)
    assert done["cleared_input_tokens"] == before - await _count(parsed.messages) > 800


@pytest.mark.parametrize("edit", [
    {"trigger": {"type": "input_tokens", "value": 10**9}},  # not reached
    {"trigger": {"type": "tool_uses", "value": 9}},
    {"clear_at_least": {"type": "input_tokens", "value": 10**9}},  # would not clear enough
    {"keep": {"type": "tool_uses", "value": 5}},  # nothing older than the kept
])
async def test_nothing_is_cleared_below_the_triggers(edit):
    body = _history(5)
    parsed, applied = await _apply(body, [{"type": context.TOOL_USES, **edit}])
    assert applied == [] and parsed == parse_messages_request(body)


async def test_thinking_of_past_turns_goes_but_the_last_kept():
    parsed, applied = await _apply(_history(3), [{"type": context.THINKING}])
    thinking = [m.get("reasoning_content") for m in parsed.messages if m["role"] == "assistant"]
    assert thinking == [None, None, "plan 2"]
    assert applied[0]["cleared_thinking_turns"] == 2 and applied[0]["cleared_input_tokens"] > 0
    kept, none = await _apply(_history(3), [{"type": context.THINKING, "keep": "all"}])
    assert none == [] and kept == parse_messages_request(_history(3))


def test_unknown_edits_are_skipped_and_bad_shapes_refused():
    edits = context.parse({"edits": [{"type": "compact_20260112"}, {"type": context.THINKING}]})
    assert edits.skipped == ["compact_20260112"] and len(edits.edits) == 1 and edits.given
    for bad in ([], {"edits": 3}, {"edits": [3]}):
        with pytest.raises(APIError) as e:
            context.parse(bad)
        assert e.value.status == 400 and e.value.param.startswith("context_management")
