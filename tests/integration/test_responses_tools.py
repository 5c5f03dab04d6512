"""The Responses API with tools, text.format and reasoning, on a tiny model with a real
tool-calling family's template (Qwen/Hermes: tools, <tool_call>, <think>); and the input
token count of such a request."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.integration.conftest import sse_events
from tests.openresponses.schema import check_event, check_response
from tests.schema import validate

WEATHER = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}
NO_THINKING = {"effort": "none"}


@pytest.fixture(scope="module")
def qwen(qwen_server, family_model):
    return qwen_server, str(family_model("qwen"))


@pytest.fixture
def oai(qwen) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen[0].url + "/v1", api_key="unused", max_retries=0)


def test_tool_round_trip_with_required_choice(oai, qwen):
    _, model = qwen
    first = oai.responses.create(model=model, input="Weather in Paris for 3 days?",
                                 tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False,  # one call, then the grammar ends
                                 reasoning=NO_THINKING, max_output_tokens=200)
    check_response(first.model_dump(exclude_unset=True))
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # Hand the results back: the model's next turn sees the call and its output.
    follow = oai.responses.create(
        model=model, previous_response_id=first.id, reasoning=NO_THINKING,
        tools=[WEATHER], max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 21}'}
               for c in calls])
    assert follow.previous_response_id == first.id and follow.status == "incomplete"
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = oai.responses.input_items.list(follow.id)
    assert [i.type for i in items.data] == ["function_call_output"] * len(calls)


def test_tool_call_events_stream(qwen):
    srv, model = qwen
    body = {"model": model, "input": "Weather?", "tools": [WEATHER], "stream": True,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "reasoning": NO_THINKING, "max_output_tokens": 200, "parallel_tool_calls": False}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json=body) as r:
            events = sse_events(r)
    for ev in events:
        check_event(ev)
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert "<tool_call>" not in json.dumps(events)  # markup never leaks
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done["arguments"]), WEATHER["parameters"])


AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "close_agent", "strict": True, "parameters": {
        "type": "object", "properties": {"target": {"type": "string", "maxLength": 8}},
        "required": ["target"], "additionalProperties": False}},
    {"type": "custom", "name": "patch", "description": "A freeform patch."}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_namespace_tools_functions_are_called_with_their_namespace(qwen, stream):
    # Codex sends its sub-agent tools and each MCP server's as a `namespace` tool: its
    # functions are offered beside the others, and a call of one names the namespace.
    srv, model = qwen
    body = {"model": model, "input": "Close agent a1.", "tools": [WEATHER, AGENTS],
            "tool_choice": {"type": "function", "name": "close_agent"}, "stream": stream,
            "reasoning": NO_THINKING, "max_output_tokens": 200, "parallel_tool_calls": False}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        if stream:
            with http.stream("POST", "/v1/responses", json=body) as r:
                events = sse_events(r)
                headers = r.headers
            for ev in events:
                check_event(ev)
            added = next(e for e in events if e["type"] == "response.output_item.added")
            assert added["item"]["namespace"] == "agents"
            first = events[-1]["response"]
        else:
            r = http.post("/v1/responses", json=body)
            first, headers = r.json(), r.headers
    check_response(first)
    [call] = first["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "close_agent",
                                                               "agents")
    jsonschema.validate(json.loads(call["arguments"]),
                        AGENTS["tools"][0]["parameters"])
    # Echoed as function tools (the Open Responses schema knows no other); its custom
    # tool is skipped, and said to be.
    assert [t["name"] for t in first["tools"]] == ["get_weather", "close_agent"]
    assert "custom" in headers["x-mlxd-warning"]
    # The call goes back with its namespace, and the chain keeps it.
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    follow = oai.responses.create(model=model, tools=[WEATHER, AGENTS], reasoning=NO_THINKING,
                                  max_output_tokens=4, input=[
                                      {k: v for k, v in call.items() if k != "status"},
                                      {"type": "function_call_output",
                                       "call_id": call["call_id"], "output": "closed"}])
    items = oai.responses.input_items.list(follow.id, order="asc").data
    assert [(i.type, getattr(i, "namespace", None)) for i in items][0] == (
        "function_call", "agents")


def test_a_function_named_twice_among_namespaces_is_a_400(oai, qwen):
    _, model = qwen
    twice = {**AGENTS, "tools": [{**AGENTS["tools"][0], "name": "get_weather"}]}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input="x", tools=[WEATHER, twice])
    assert e.value.body["param"] == "tools[1].tools" and "get_weather" in e.value.message


def test_tool_choice_none_makes_no_calls(oai, qwen):
    _, model = qwen
    r = oai.responses.create(model=model, input="Weather?", tools=[WEATHER], tool_choice="none",
                             reasoning=NO_THINKING, max_output_tokens=30)
    assert not [o for o in r.output if o.type == "function_call"]


def test_json_schema_text_format_validates(oai, qwen):
    _, model = qwen
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "tags", "n"], "additionalProperties": False}
    r = oai.responses.create(model=model, input="Describe", reasoning=NO_THINKING,
                             max_output_tokens=200, text={"format": {
                                 "type": "json_schema", "name": "thing", "schema": schema,
                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_reasoning_becomes_a_reasoning_item(qwen):
    srv, model = qwen
    body = {"model": model, "input": "Think first", "reasoning": {"effort": "high"},
            "max_output_tokens": 12, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json=body) as r:
            events = sse_events(r)
    for ev in events:
        check_event(ev)
    final = events[-1]["response"]
    assert final["output"][0]["type"] == "reasoning"
    text = final["output"][0]["content"][0]["text"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == text and text and "<think>" not in json.dumps(final)
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_a_reasoning_summary_asked_for_streams_through_the_sdk(oai, qwen):
    # `reasoning.summary` (as Codex and the Vercel AI SDK send it): the reasoning is its
    # own summary, streamed as summary events the official SDK parses into its types, and
    # the same item as a stored response.
    _, model = qwen
    events = list(oai.responses.create(model=model, input="Think first", max_output_tokens=12,
                                       reasoning={"effort": "high", "summary": "auto"},
                                       stream=True))
    kinds = [e.type for e in events]
    final = events[-1].response  # (incomplete: cut off by max_output_tokens)
    assert final.reasoning.summary == "auto"
    item = final.output[0]
    assert item.type == "reasoning" and item.content[0].text
    assert [p.text for p in item.summary] == [item.content[0].text]
    assert kinds.count("response.reasoning_summary_text.delta") == kinds.count(
        "response.reasoning_text.delta") > 0
    assert "response.reasoning_summary_part.done" in kinds
    assert oai.responses.retrieve(final.id).output[0].summary == item.summary


def test_a_sealed_reasoning_comes_back_into_the_prompt_without_a_store(oai, qwen):
    # include: ["reasoning.encrypted_content"] with store: false (the Vercel AI SDK sends
    # back only reasoning items that carry it): the item's text sealed, unreadable to the
    # client; sent back in a tool loop without its text, it is the prompt's reasoning
    # again (as many prompt tokens as the same item in clear, more than without it).
    _, model = qwen
    first = oai.responses.create(model=model, input="Think first", max_output_tokens=12,
                                 reasoning={"effort": "high"}, store=False,
                                 include=["reasoning.encrypted_content"])
    item = first.output[0]
    text = item.content[0].text
    assert item.type == "reasoning" and text and item.encrypted_content
    assert text not in item.encrypted_content

    def counted(reasoning: dict | None) -> int:
        items = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
        items += [{"type": "reasoning", "id": item.id, "summary": [], **reasoning}] \
            if reasoning else []
        items += [{"type": "function_call", "call_id": "c1", "name": "get_weather",
                   "arguments": '{"city": "Paris", "days": 3}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
        return oai.responses.input_tokens.count(model=model, input=items,
                                                tools=[WEATHER]).input_tokens

    sealed = counted({"encrypted_content": item.encrypted_content})
    clear = counted({"content": [{"type": "reasoning_text", "text": text}]})
    assert sealed == clear > counted(None)
    assert counted({"encrypted_content": item.encrypted_content[:-4] + "AAAA"}) == counted(None)


def test_input_tokens_counts_the_prompt_a_response_gets(oai, qwen):
    # POST /v1/responses/input_tokens (`client.responses.input_tokens.count`): nothing
    # generated or stored; instructions and tools rendered by the template, and a stored
    # chain before `previous_response_id`, count as the response's prompt.
    _, model = qwen
    ask = {"model": model, "input": "Weather in Paris for 3 days?", "instructions": "Be brief.",
           "tools": [WEATHER], "reasoning": NO_THINKING}
    counted = oai.responses.input_tokens.count(**ask)
    validate(counted.model_dump(), "TokenCountsResource", strict=True)
    first = oai.responses.create(**ask, max_output_tokens=4)
    assert counted.input_tokens == first.usage.input_tokens
    bare = oai.responses.input_tokens.count(model=model, input="Weather in Paris for 3 days?")
    assert 0 < bare.input_tokens < counted.input_tokens   # the tools and instructions count
    # After a stored response, its chain counts too.
    then = {"model": model, "previous_response_id": first.id, "input": "And in Rome?",
            "tools": [WEATHER], "reasoning": NO_THINKING}
    chained = oai.responses.input_tokens.count(**then)
    follow = oai.responses.create(**then, max_output_tokens=4)
    assert chained.input_tokens == follow.usage.input_tokens > counted.input_tokens
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_tokens.count(model=model, previous_response_id="resp_gone",
                                         input="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.input_tokens.count(model=model, input=[{"type": "nonsense"}])
    assert e.value.body["param"].startswith("input")
