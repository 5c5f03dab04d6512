"""Responses API pieces without a server: request parsing, items → chat messages, and
the event builder checked against OpenAI's spec."""

from __future__ import annotations

import pytest

from protocol import PromptCache
from protocol.messages import IMAGE_PLACEHOLDER
from supervisor.api.chat.request import parse_chat_request
from supervisor.api.completions.request import parse_completion_request
from supervisor.api.responses.builder import ResponseBuilder, replay, usage
from supervisor.api.responses.items import normalize_input, output_to_items, to_chat_messages
from supervisor.api.responses.request import parse_responses_request
from supervisor.config import Config
from supervisor.http.errors import APIError
from tests.openresponses.schema import check_event, check_response
from tests.schema import validate


def req(**kw):
    return parse_responses_request({"model": "m", "input": "hi", **kw})


def test_builder_events_for_reasoning_text_and_calls_are_valid_and_ordered():
    b = ResponseBuilder(req(tools=[{"type": "function", "name": "f", "parameters": {}}]), "m")
    events = b.start()
    events += b.reasoning("thinking ") + b.reasoning("more")
    events += b.text("Hello") + b.text(" world")
    events += b.function_call("f", '{"a": 1}')
    events += b.function_call("f", '{"a": 2}')
    events += b.text("after")
    events += b.finish("completed", usage=usage(5, 9, reasoning_tokens=3))
    for ev in events:
        check_event(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    check_response(final)
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call",
                                                    "function_call", "message"]
    assert final["output"][0]["content"][0]["text"] == "thinking more"
    assert final["output"][1]["content"][0]["text"] == "Hello world"
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    assert len({c["call_id"] for c in calls}) == 2 and calls[1]["arguments"] == '{"a": 2}'
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 5
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_a_summary_asked_for_is_the_reasoning_itself_in_summary_events():
    # `reasoning.summary` (Codex and the Vercel AI SDK ask for one; the AI SDK reads only
    # summaries): no model here writes summaries, so the reasoning is its own summary, in
    # one summary part streamed beside the reasoning text, each event valid in OpenAI's
    # spec and the Open Responses schema; replayed the same; not asked for, none.
    b = ResponseBuilder(req(reasoning={"effort": "low", "summary": "auto"}), "m")
    events = b.start() + b.reasoning("thinking ") + b.reasoning("more") + b.text("Hi")
    events += b.finish("completed", usage=usage(5, 3))
    names = {"response.reasoning_summary_part.added": "ResponseReasoningSummaryPartAddedEvent",
             "response.reasoning_summary_text.delta": "ResponseReasoningSummaryTextDeltaEvent",
             "response.reasoning_summary_text.done": "ResponseReasoningSummaryTextDoneEvent",
             "response.reasoning_summary_part.done": "ResponseReasoningSummaryPartDoneEvent"}
    for ev in events:
        check_event(ev)
        if ev["type"] in names:
            validate(ev, names[ev["type"]], strict=True)
    item = events[-1]["response"]["output"][0]
    assert item["summary"] == [{"type": "summary_text", "text": "thinking more"}]
    assert item["content"] == [{"type": "reasoning_text", "text": "thinking more"}]
    kinds = [e["type"] for e in events]
    summary = [k for k in kinds if "summary" in k]
    assert summary == ["response.reasoning_summary_part.added",
                       "response.reasoning_summary_text.delta",
                       "response.reasoning_summary_text.delta",
                       "response.reasoning_summary_text.done",
                       "response.reasoning_summary_part.done"]
    assert kinds.index("response.reasoning_summary_part.done") < kinds.index(
        "response.output_item.done")
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["summary"] == []  # (the part comes by its own event)
    again = replay(events[-1]["response"])
    assert again[-1]["response"] == events[-1]["response"]
    assert [e["type"] for e in again if "summary" in e["type"]] == [
        k for i, k in enumerate(summary) if i != 2]  # (one delta: the whole text)
    plain = ResponseBuilder(req(reasoning={"effort": "low"}), "m")
    quiet = plain.start() + plain.reasoning("x") + plain.finish("completed", usage=usage(1, 1))
    assert quiet[-1]["response"]["output"][0]["summary"] == []
    assert not [e for e in quiet if "summary" in e["type"]]


@pytest.mark.parametrize("reasoning", [{"summary": "brief"}, {"summary": 3},
                                       {"generate_summary": "all"}])
def test_a_reasoning_summary_outside_the_spec_is_a_400_naming_it(reasoning):
    with pytest.raises(APIError) as e:
        req(reasoning=reasoning)
    assert e.value.status == 400 and e.value.param == f"reasoning.{next(iter(reasoning))}"


def test_the_deprecated_generate_summary_asks_for_a_summary_too():
    assert req(reasoning={"generate_summary": "detailed"}).reasoning["summary"] == "detailed"


@pytest.mark.parametrize("status,extra,event", [
    ("incomplete", {"incomplete_reason": "max_output_tokens"}, "response.incomplete"),
    ("failed", {"error": {"code": "server_error", "message": "worker died; retry"}},
     "response.failed"),
])
def test_terminal_states(status, extra, event):
    b = ResponseBuilder(req(), "m")
    events = b.start() + b.text("x") + b.finish(status, usage=usage(1, 1), **extra)
    for ev in events:
        check_event(ev)
    assert events[-1]["type"] == event and events[-1]["response"]["status"] == status


def test_a_lifecycle_events_response_is_the_response_as_it_stood_then():
    # The created / in_progress events hold the response as it was when they were made,
    # however much output follows before they are written (the official SDK's stream
    # helper refused a response.created that already held the call it was then told of:
    # "Duplicate response output index 0"), and a replay's created event is empty too.
    b = ResponseBuilder(req(tools=[{"type": "function", "name": "f", "parameters": {}}]), "m")
    early = b.start()
    events = early + b.reasoning("r") + b.text("a") + b.function_call("f", "{}")
    events += b.finish("completed", usage=usage(1, 3))
    assert [e["response"]["output"] for e in early] == [[], []]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert "content" not in final["output"][2]
    again = replay(final)
    assert again[0]["response"]["output"] == [] and again[-1]["response"] == final


def test_replay_retells_a_stored_response():
    b = ResponseBuilder(req(), "m")
    live = b.start() + b.reasoning("r") + b.text("a") + b.text("b") + b.function_call("f", "{}")
    live += b.finish("completed", usage=usage(1, 3))
    again = replay(live[-1]["response"])
    for ev in again:
        check_event(ev)
    assert again[-1]["response"] == live[-1]["response"]
    assert [e.get("item_id") for e in again] == [e.get("item_id") for e in live
                                                 if e["type"] != "response.output_text.delta"
                                                 or e["delta"] == "a"]


def test_items_to_chat_messages():
    items = normalize_input([
        {"role": "developer", "content": "rule one"},
        {"role": "system", "content": [{"type": "input_text", "text": "rule two"}]},
        {"role": "user", "content": "call it"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should call f"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"role": "assistant", "content": "done"},
        # A tool that answers with an image (Codex's view_image): its placeholder.
        {"type": "function_call", "call_id": "c3", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": [
            {"type": "input_text", "text": "the screen: "},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
    ])
    msgs = to_chat_messages(items, "be brief")
    assert msgs[0] == {"role": "system", "content": "be brief\n\nrule one\n\nrule two"}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool",
                                         "assistant", "tool"]
    call = msgs[2]
    assert call["reasoning_content"] == "I should call f"
    assert [c["id"] for c in call["tool_calls"]] == ["c1", "c2"]
    assert call["tool_calls"][1]["function"] == {"name": "g", "arguments": '{"x":1}'}
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert msgs[4]["content"] == "two"
    assert msgs[5]["tool_calls"][0]["function"]["name"] == "view_image"
    assert msgs[6]["content"] == "the screen: " + IMAGE_PLACEHOLDER
    assert all("id" in i for i in items)
    with pytest.raises(APIError) as e:
        normalize_input([{"type": "function_call_output", "call_id": "c", "output": [
            {"type": "refusal", "refusal": "no"}]}])
    assert e.value.param == "input[0].output[0]"


def test_output_items_replay_as_input():
    out = [{"type": "message", "role": "assistant", "content": [{"type": "output_text",
            "text": "hi", "annotations": [], "logprobs": []}], "id": "m", "status": "completed"},
           {"type": "function_call", "id": "f", "call_id": "c", "name": "n", "arguments": "{}"}]
    msgs = to_chat_messages(output_to_items(out), None)
    assert msgs == [{"role": "assistant", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "n", "arguments": "{}"}}]}]


def test_request_tools_choice_and_formats():
    r = req(tools=[{"type": "function", "name": "a", "parameters": {"type": "object"}},
                   {"type": "function", "function": {"name": "b", "description": "nested"}},
                   {"type": "web_search"}, {"type": "file_search"}],
            tool_choice={"type": "function", "name": "b"},
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            reasoning={"effort": "low"}, metadata={"k": "v"}, instructions="sys")
    echo = r.tools_echo
    assert [t["name"] for t in echo] == ["a", "b"] and echo[1]["description"] == "nested"
    for t in echo:
        validate(t, "FunctionTool")
    assert r.skipped_tools == ["web_search", "file_search"]
    assert r.tool_choice.mode == "required" and r.tool_choice.allowed == ("b",)
    assert r.text_format.kind == "json_schema" and r.reasoning_effort == "low"
    g = r.to_generate(r.input_items, Config(), "resp_1")
    out = g.output
    assert out.tool_choice == "required" and out.allowed_tools == ("b",)
    assert out.response_format == "json_schema" and out.reasoning_effort == "low"
    assert [t["function"]["name"] for t in out.tools] == ["a", "b"]
    assert g.messages[0] == {"role": "system", "content": "sys"}
    with pytest.raises(APIError) as e:
        req(tool_choice={"type": "function", "name": "missing"})
    assert e.value.param == "tool_choice"
    with pytest.raises(APIError) as e:
        req(tool_choice="required")
    assert e.value.param == "tool_choice"
    with pytest.raises(APIError) as e:
        req(text={"format": {"type": "json_schema", "schema": {}}})
    assert e.value.param == "text.format.name"
    with pytest.raises(APIError) as e:
        parse_responses_request({"model": "m"})
    assert e.value.param == "input"


@pytest.mark.parametrize("kind", ["\u001f", "web search", "x\r\nSet-Cookie: a=b", "A" * 65, ""])
def test_a_tool_type_that_is_no_tool_type_is_a_400_not_a_header(kind):
    # Skipped built-in tools are named in the X-MLXD-Warning header: only names shaped
    # like OpenAI's tool types may get there.
    from supervisor.api.responses.request import parse_responses_request

    with pytest.raises(APIError) as err:
        parse_responses_request({"model": "m", "input": "hi", "tools": [{"type": kind}]})
    assert err.value.status == 400 and err.value.param == "tools[0].type"
    req = parse_responses_request({"model": "m", "input": "hi", "tools": [
        {"type": "web_search_preview_2025_03_11"}]})
    assert req.skipped_tools == ["web_search_preview_2025_03_11"]


def test_kv_snapshot_names_follow_the_store_and_the_cache_key():
    """A stored response keeps its final KV state under its own id, an unstored one under
    its prompt_cache_key; a turn resumes from its previous response, else from the key."""
    def names(**body):
        cache = req(**body).to_generate([], Config(), "resp_new").cache
        # Logs may name a response id, never a client's key.
        assert cache.resume_label == (cache.resume_from if body.get("previous_response_id")
                                      else "a prompt_cache_key snapshot" if cache.resume_from
                                      else "")
        assert cache.namespace == body.get("prompt_cache_key")
        return cache.keep_as, cache.resume_from

    assert names() == ("resp_new", None)
    assert names(previous_response_id="resp_old") == ("resp_new", "resp_old")
    assert names(store=False) == (None, None)
    assert names(store=False, prompt_cache_key="conv") == ("key:conv", "key:conv")
    assert names(prompt_cache_key="conv") == ("resp_new", "key:conv")
    assert names(prompt_cache_key="conv", previous_response_id="resp_old") == (
        "resp_new", "resp_old")
    chat = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "prompt_cache_key": "conv"}).to_generate(Config())
    assert chat.cache == PromptCache(namespace="conv", keep_as="key:conv",
                                     resume_from="key:conv",
                                     resume_label="a prompt_cache_key snapshot")
    completion = parse_completion_request({"model": "m", "prompt": "x",
                                           "prompt_cache_key": "conv"}).to_generate(Config())
    assert completion.cache == chat.cache
    with pytest.raises(APIError) as e:
        req(prompt_cache_key="k" * 1025)
    assert e.value.param == "prompt_cache_key" and e.value.status == 400
