"""Anthropic Messages bodies → the chat-form Generate the worker renders
(supervisor/api/messages/request.py): every block kind, tools and tool_choice, thinking,
and the refusals, each naming what is wrong."""

from __future__ import annotations

import json

import pytest

from protocol import Task
from supervisor.api.messages.request import parse_messages_request
from supervisor.api.responses.seal import SUMMARY_HEADER
from supervisor.config import Config
from supervisor.http.errors import APIError

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


def body(**kw) -> dict:
    return {"model": "m", "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}], **kw}


def generate(**kw):
    return parse_messages_request(body(**kw)).to_generate(Config())


def test_system_and_text_become_chat_messages():
    gen = generate(system=[{"type": "text", "text": "Be brief.", "cache_control":
                            {"type": "ephemeral"}}, {"type": "text", "text": "Be kind."}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "c"}])
    assert gen.messages == [{"role": "system", "content": "Be brief.\nBe kind."},
                            {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": "c"}]
    assert gen.task is Task.GENERATE and gen.sampling.max_tokens == 16


def test_system_messages_in_the_conversation_go_where_templates_take_them():
    gen = generate(system="Top.", messages=[
        {"role": "system", "content": "Also top."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "user", "content": "c"},
        {"role": "system", "content": "Last word."}])
    assert gen.messages == [{"role": "system", "content": "Top.\nAlso top."},
                            {"role": "user", "content": "a"},
                            {"role": "assistant", "content": "b"},
                            {"role": "user", "content": "Reminder.\nc\nLast word."}]
    # At the end with no user message before it: a user message of its own.
    gen = generate(messages=[{"role": "user", "content": "a"},
                             {"role": "assistant", "content": "b"},
                             {"role": "system", "content": "Last word."}])
    assert gen.messages[-1] == {"role": "user", "content": "Last word."}


def test_a_system_message_after_a_user_one_renders_alike_in_the_next_turn():
    """Claude Code sends its environment as a system message after the first user message,
    turn after turn: the first turn's messages must be the second's beginning, or the
    second turn's prompt parts from the first's there and its prefix cache goes unused."""
    env = {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}
    first = generate(messages=[{"role": "user", "content": "Say hello."}, env]).messages
    second = generate(messages=[{"role": "user", "content": "Say hello."}, env,
                                {"role": "assistant", "content": "Hello."},
                                {"role": "user", "content": "Name a color."}]).messages
    assert first == [{"role": "user", "content": "Say hello.\n# Environment"}]
    assert second[:len(first)] == first and second[-1]["content"] == "Name a color."


def test_max_tokens_is_a_ceiling_and_effort_follows_output_config():
    gen = generate(max_tokens=32000, thinking={"type": "adaptive"},
                   output_config={"effort": "low"})
    assert gen.sampling.max_tokens == 32000 and gen.sampling.max_tokens_ceiling
    assert gen.output.reasoning_effort == "low"
    assert generate(thinking={"type": "adaptive"}).output.reasoning_effort == "medium"


def test_tool_use_and_results_become_calls_and_tool_messages():
    gen = generate(tools=[TOOL], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need a tool", "signature": "sig"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "21C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom",
             "is_error": True},
            {"type": "text", "text": "thanks"}]}])
    assistant = gen.messages[1]
    assert assistant["content"] == "Let me look."
    assert assistant["reasoning_content"] == "need a tool"
    call = assistant["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert gen.messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "thanks"}]
    assert gen.output.tools[0]["function"]["parameters"] == TOOL["input_schema"]


@pytest.mark.parametrize("choice,mode,allowed,parallel", [
    (None, "auto", None, True), ({"type": "auto"}, "auto", None, True),
    ({"type": "any"}, "required", None, True), ({"type": "none"}, "none", None, True),
    ({"type": "tool", "name": "get_weather"}, "required", ("get_weather",), True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", None, False),
])
def test_tool_choice_maps_onto_the_grammar(choice, mode, allowed, parallel):
    extra = {"tool_choice": choice} if choice is not None else {}
    out = generate(tools=[TOOL], **extra).output
    assert (out.tool_choice, out.allowed_tools, out.parallel_tool_calls) == (mode, allowed,
                                                                             parallel)


def test_any_without_tools_is_worded_as_this_api_words_it():
    with pytest.raises(APIError) as e:
        parse_messages_request(body(tool_choice={"type": "any"}))
    assert e.value.param == "tool_choice.type" and "'any'" in e.value.message
    assert "required" not in e.value.message   # (OpenAI's word for it)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.mark.parametrize("extra", [
    {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"}},
    {"output_format": {"type": "json_schema", "schema": SCHEMA}},   # the beta's own field
])
def test_an_output_format_becomes_the_grammars_schema(extra):
    out = generate(**extra).output
    assert (out.response_format, out.json_schema) == ("json_schema", SCHEMA)


@pytest.mark.parametrize("extra,param", [
    ({"output_config": {"format": "json"}}, "output_config.format"),
    ({"output_config": {"format": {"schema": SCHEMA}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "xml", "schema": SCHEMA}}},
     "output_config.format.type"),
    ({"output_format": {"type": "json_schema"}}, "output_format.schema"),
    ({"output_format": {"type": "json_schema", "schema": []}}, "output_format.schema"),
])
def test_a_bad_output_format_is_a_400_naming_it(extra, param):
    with pytest.raises(APIError) as e:
        parse_messages_request(body(**extra))
    assert (e.value.status, e.value.param) == (400, param)


def test_a_compaction_block_stands_for_what_it_summarised():
    summary = {"type": "compaction", "content": "Task: the weather.", "signature": "s"}
    gen = generate(messages=[
        {"role": "assistant", "content": [summary]},
        {"role": "assistant", "content": [{"type": "compaction", "content": None}]},
        {"role": "user", "content": "go on"}])
    assert gen.messages == [
        {"role": "user", "content": SUMMARY_HEADER + "Task: the weather."},
        {"role": "user", "content": "go on"}]
    with pytest.raises(APIError) as e:
        parse_messages_request(body(messages=[{"role": "assistant", "content": [
            {"type": "compaction", "content": ""}]}]))
    assert e.value.param == "messages[0].content[0].content"


def test_server_tools_are_skipped_and_named():
    parsed = parse_messages_request(body(tools=[TOOL, {"type": "web_search_20250305",
                                                       "name": "web_search"}]))
    assert [t["function"]["name"] for t in parsed.tools] == ["get_weather"]
    assert parsed.skipped_tools == ("web_search",)


@pytest.mark.parametrize("thinking,effort", [
    (None, None), ({"type": "disabled"}, "none"), ({"type": "adaptive"}, "medium"),
    ({"type": "enabled", "budget_tokens": 1024}, "low"),
    ({"type": "enabled", "budget_tokens": 8000}, "medium"),
    ({"type": "enabled", "budget_tokens": 32000}, "high"),
])
def test_thinking_maps_onto_the_reasoning_switch(thinking, effort):
    extra = {"thinking": thinking} if thinking is not None else {}
    assert generate(**extra).output.reasoning_effort == effort


def test_a_system_message_joins_a_user_message_with_an_image_as_a_text_part():
    # (It joined the content as a string: a TypeError, a 500, for parts.)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    gen = generate(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "Env."},
        {"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]},
        {"role": "system", "content": "After."}])
    assert gen.messages[-1]["content"] == [{"type": "text", "text": "Env."}, {"type": "image"},
                                           {"type": "text", "text": "what is it?\nAfter."}]
    assert gen.images == (b"\x89PNG\r\n\x1a\n",)


def test_images_travel_to_the_worker_as_parts_and_bytes():
    # A vision worker sees them; a text worker applies the media rule itself
    # (worker/prompt.py, tested in tests/worker/test_worker_vision.py).
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    gen = generate(messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [{"type": "document", "source": {
            "type": "text", "media_type": "text/plain", "data": "doc text"}}]}])
    assert gen.messages[0]["content"] == [{"type": "image"},
                                          {"type": "text", "text": "what is it?"}]
    assert gen.images == (b"\x89PNG\r\n\x1a\n",)
    assert gen.messages[2]["content"] == "doc text"
    for source, param in (({"type": "url", "url": "https://example.com/a.png"},
                           "messages[0].content[0].source.type"),
                          ({"type": "base64", "media_type": "text/plain", "data": "aGk="},
                           "messages[0].content[0].source.media_type"),
                          ({"type": "base64", "media_type": "image/png", "data": "%%%"},
                           "messages[0].content[0].source.data")):
        with pytest.raises(APIError) as e:
            generate(messages=[{"role": "user", "content": [{"type": "image", "source": source}]}])
        assert e.value.status == 400 and e.value.param == param


def test_count_tokens_needs_no_max_tokens_and_tokenizes_the_same_prompt():
    b = body(system="s", tools=[TOOL])
    del b["max_tokens"]
    with pytest.raises(APIError, match="max_tokens"):
        parse_messages_request(b)
    counted = parse_messages_request(b, count_only=True).to_generate(Config(), Task.TOKENIZE)
    full = parse_messages_request({**b, "max_tokens": 5}).to_generate(Config())
    assert counted.task is Task.TOKENIZE
    assert counted.messages == full.messages and counted.output.tools == full.output.tools


@pytest.mark.parametrize("bad,param", [
    ({"model": None}, "model"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ({"tool_choice": {"type": "maybe"}}, "tool_choice.type"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f",
                                                       "input": {}}]}]},
     "messages[0].content[0].id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
])
def test_bad_bodies_are_400s_naming_the_field(bad, param):
    b = {**body(), **bad}
    if b.get("model") is None:
        b.pop("model")
    with pytest.raises(APIError) as e:
        parse_messages_request(b)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
