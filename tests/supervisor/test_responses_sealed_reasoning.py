"""A reasoning item's text sealed in its `encrypted_content` (include:
["reasoning.encrypted_content"]; supervisor/api/responses/seal.py) for a client that keeps
no state: sealed when the item is done, only this key opens it and only as reasoning,
and it becomes the prompt's reasoning again when it comes back without its text."""

from __future__ import annotations

from supervisor.api.responses.builder import ResponseBuilder, replay, usage
from supervisor.api.responses.items import normalize_input, to_chat_messages
from supervisor.api.responses.request import parse_responses_request
from supervisor.api.responses.seal import Sealer, expand
from tests.openresponses.schema import check_event, check_response

INCLUDE = ["reasoning.encrypted_content"]


def test_a_sealed_reasoning_opens_only_as_reasoning_and_only_with_its_key():
    sealer = Sealer("k")
    content = sealer.seal_reasoning("first I check the file")
    assert "check" not in content and content.startswith("mlxd1.")
    assert sealer.open_reasoning(content) == "first I check the file"
    assert sealer.open(content) is None  # (not a compaction item's)
    assert sealer.open_reasoning(sealer.seal("a summary")) is None
    assert Sealer("another key").open_reasoning(content) is None
    assert sealer.open_reasoning("gAAAAABpM0Yj-OpenAIs-own=") is None


def test_the_builder_seals_a_reasoning_item_when_it_is_done():
    sealer = Sealer("k")
    req = parse_responses_request({"model": "m", "input": "hi", "include": INCLUDE,
                                   "reasoning": {"effort": "high"}})
    assert req.sealed_reasoning
    b = ResponseBuilder(req, "m", sealer=sealer)
    events = b.start() + b.reasoning("think ") + b.reasoning("twice") + b.text("Hi")
    events += b.finish("completed", usage=usage(3, 3))
    for ev in events:
        check_event(ev)
    final = events[-1]["response"]
    check_response(final)
    item = final["output"][0]
    assert sealer.open_reasoning(item["encrypted_content"]) == "think twice"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["encrypted_content"] == item["encrypted_content"]
    again = replay(final)  # (a stored response re-told: the same sealed text)
    assert [e["item"].get("encrypted_content") for e in again
            if e["type"] == "response.output_item.done"][0] == item["encrypted_content"]
    plain = ResponseBuilder(parse_responses_request({"model": "m", "input": "hi"}), "m")
    assert not parse_responses_request({"model": "m", "input": "hi"}).sealed_reasoning
    out = plain.start() + plain.reasoning("x") + plain.finish("completed", usage=usage(1, 1))
    assert "encrypted_content" not in out[-1]["response"]["output"][0]


def _loop(reasoning: dict | None) -> list[dict]:
    """A tool loop's items with `reasoning` (an item's fields) before its call."""
    return normalize_input(
        [{"role": "user", "content": "Weather?"}]
        + ([{"type": "reasoning", "id": "rs_1", "summary": [], **reasoning}] if reasoning else [])
        + [{"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
           {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])


def test_a_reasoning_sent_back_sealed_is_the_prompts_reasoning_again():
    sealer = Sealer("k")

    def reasoning_of(items):
        (call,) = [m for m in to_chat_messages(expand(items, sealer), None)
                   if m["role"] == "assistant"]
        return call.get("reasoning_content")

    sealed = sealer.seal_reasoning("look it up")
    assert reasoning_of(_loop({"encrypted_content": sealed})) == "look it up"
    # Its own text wins; another server's content is no text at all, and no error.
    assert reasoning_of(_loop({"encrypted_content": sealed, "content": [
        {"type": "reasoning_text", "text": "as sent"}]})) == "as sent"
    assert reasoning_of(_loop({"encrypted_content": Sealer("other").seal_reasoning("x")})) is None
    assert reasoning_of(_loop(None)) is None
