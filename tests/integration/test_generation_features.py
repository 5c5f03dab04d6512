"""Tool calls, JSON schema, logprobs and reasoning end to end: the real supervisor and
worker on a tiny model with a Qwen/Hermes-style template (tools, <tool_call>, <think>),
through the official `openai` client and raw SSE, every body and chunk checked against
OpenAI's spec (reasoning_content is ours, so those bodies are checked without it)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.integration.conftest import assert_envelope, sse_events
from tests.schema import validate

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(family_model) -> str:
    return str(family_model("qwen"))


@pytest.fixture
def oai(qwen_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def raw(qwen_server):
    with httpx.Client(base_url=qwen_server.url, timeout=60) as c:
        yield c


def stream(raw, body) -> list:
    with raw.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_required_tool_call_whole_and_streamed(oai, raw, model):
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=0, max_tokens=200, extra_body=NO_THINKING)
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    validate(r.model_dump(exclude_unset=True), "CreateChatCompletionResponse", strict=True)

    body = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_tokens": 200,
            **NO_THINKING}
    chunks = stream(raw, body)
    for c in chunks:
        validate(c, "CreateChatCompletionStreamResponse", strict=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # no markup leaks into content
    frags = [tc for d in deltas for tc in d.get("tool_calls") or ()]
    assert frags[0]["id"] and frags[0]["function"]["name"] == call.function.name
    assert all(f["index"] == 0 for f in frags)
    args = "".join(f["function"].get("arguments") or "" for f in frags)
    assert args == call.function.arguments  # greedy: the same call as non-streamed
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_named_and_none_tool_choice(oai, model):
    r = oai.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, extra_body=NO_THINKING)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_time"])
    r = oai.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                    tool_choice="none", temperature=0, max_tokens=30,
                                    extra_body=NO_THINKING)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content


def test_tool_history_round_trip(oai, model):
    first = oai.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=200, extra_body=NO_THINKING)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r = oai.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                    temperature=0, max_tokens=8, extra_body=NO_THINKING)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 10


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "kind": {"enum": ["a", "b"]}},
     "required": ["n", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["id"]}}}, "required": ["items"]},
])
def test_json_schema_whole_and_streamed(oai, raw, model, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                  "strict": True}}
    r = oai.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt,
                                    temperature=0, max_tokens=200, extra_body=NO_THINKING)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert r.choices[0].finish_reason == "stop"
    chunks = stream(raw, {"model": model, "messages": MESSAGES, "response_format": fmt,
                          "temperature": 0, "max_tokens": 200, **NO_THINKING})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    # json_object
    r = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                    response_format={"type": "json_object"}, max_tokens=200,
                                    extra_body=NO_THINKING)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_each_of_n_sampled_choices_keeps_the_grammar_and_its_own_tool_calls(oai, model):
    """`n` choices sampled apart (seed + j): each is held to the response format, and
    each choice's tool call is parsed as its own."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                  "strict": True}}
    r = oai.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt, n=3,
                                    temperature=1.0, seed=3, max_tokens=200,
                                    extra_body=NO_THINKING)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    r = oai.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, n=3,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=1.0, seed=3, max_tokens=200,
                                    extra_body=NO_THINKING)
    ids = set()
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        ids.add(call.id)
    assert len(ids) == 3


def test_chat_logprobs_whole_and_streamed(oai, raw, model):
    r = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                    max_tokens=10, logprobs=True, top_logprobs=4,
                                    extra_body=NO_THINKING)
    validate(r.model_dump(exclude_unset=True), "CreateChatCompletionResponse", strict=True)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 4
        assert t.top_logprobs[0].token == t.token  # temperature 0: the argmax
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True)
        assert isinstance(t.bytes, list)
    chunks = stream(raw, {"model": model, "messages": MESSAGES, "temperature": 0,
                          "max_tokens": 10, "logprobs": True, "top_logprobs": 4, **NO_THINKING})
    for c in chunks:
        validate(c, "CreateChatCompletionStreamResponse", strict=True)
    streamed = [t for c in chunks if c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["token"] for t in streamed] == [t.token for t in content]


def test_text_completion_logprobs(raw, model):
    r = raw.post("/v1/completions", json={"model": model, "prompt": "Once upon", "max_tokens": 6,
                                          "temperature": 0, "logprobs": 2})
    body = r.json()
    validate(body, "CreateCompletionResponse", strict=True)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and all(x <= 0 for x in lp["token_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_reasoning_split_whole_and_streamed(raw, model):
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 12}
    r = raw.post("/v1/chat/completions", json=body).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"]  # the template opened <think>: the output is thinking
    assert "<think>" not in (msg["content"] or "") and "</think>" not in (msg["content"] or "")
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    reasoning = msg.pop("reasoning_content")
    validate(r, "CreateChatCompletionResponse", strict=True)
    chunks = stream(raw, body)
    streamed = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    assert streamed == reasoning
    # reasoning_effort "none" turns the template's thinking off
    r = raw.post("/v1/chat/completions", json={**body, "reasoning_effort": "none"}).json()
    assert "reasoning_content" not in r["choices"][0]["message"]
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_feature_errors(raw, model):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    r = raw.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES,
                                               "response_format": bad_schema})
    assert_envelope(r, 400, param="response_format")
    r = raw.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES,
                                               "response_format": {"type": "yaml"}})
    assert_envelope(r, 400, param="response_format.type")
