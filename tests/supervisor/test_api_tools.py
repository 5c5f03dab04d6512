"""Tools, tool_choice and response_format validation (shared by chat and Responses)."""

from __future__ import annotations

import pytest

from protocol import Generate, OutputSpec, SamplingParams, decode_down, encode
from supervisor.api.fields import generate as build
from supervisor.api.fields.tools import (ResponseFormat, ToolChoice, normalize_tools,
                                         parse_response_format, parse_tool_choice)
from supervisor.api.fields.tools import output as output_spec
from supervisor.http.errors import APIError

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
NESTED = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                           "parameters": PARAMS, "strict": True}}
FLAT = {"type": "function", "name": "get_weather", "description": "d", "parameters": PARAMS,
        "strict": True}


def test_nested_and_flat_tools_normalize_alike():
    assert normalize_tools([NESTED]) == normalize_tools([FLAT]) == (NESTED,)
    assert normalize_tools(None) == ()


@pytest.mark.parametrize("tools,param", [
    ([{"type": "function", "name": "a b"}], "tools[0].name"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "name": "f"}],
     "tools"),
    ([{"type": "function", "function": "f"}], "tools[0].function"),
    ([{"name": "f"}], "tools[0].type"),
    ([{"type": "function", "name": "f", "parameters": "x"}], "tools[0].parameters"),
])
def test_bad_tools(tools, param):
    with pytest.raises(APIError) as e:
        normalize_tools(tools)
    assert e.value.status == 400 and e.value.param == param


def test_tool_choice_forms():
    tools = normalize_tools([FLAT, {"type": "function", "name": "other"}])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice("none", tools) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    named = ToolChoice("required", ("other",))
    assert parse_tool_choice({"type": "function", "function": {"name": "other"}}, tools) == named
    assert parse_tool_choice({"type": "function", "name": "other"}, tools) == named
    allowed = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function",
                                                                    "name": "other"}]}
    assert parse_tool_choice(allowed, tools) == ToolChoice("auto", ("other",))
    nested = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "other"}}]}}
    assert parse_tool_choice(nested, tools) == named
    for bad in ("bogus", {"type": "function", "name": "missing"}, {"type": "custom"}, 3,
                {"type": "allowed_tools", "mode": "x", "tools": []}):
        with pytest.raises(APIError):
            parse_tool_choice(bad, tools)


def test_response_format_forms():
    schema = {"type": "object"}
    chat = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    flat = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    assert parse_response_format(chat) == parse_response_format(flat) == ResponseFormat(
        "json_schema", schema, "x", True)
    assert parse_response_format({"type": "json_object"}).kind == "json_object"
    assert parse_response_format(None) == ResponseFormat("text")
    for bad, param in (({"type": "xml"}, "response_format.type"),
                       ({"type": "json_schema"}, "response_format.name"),
                       ({"type": "json_schema", "json_schema": []}, "response_format.json_schema")):
        with pytest.raises(APIError) as e:
            parse_response_format(bad)
        assert e.value.param == param


def test_tools_choice_and_format_make_a_valid_output_spec():
    tools = normalize_tools([FLAT])
    out = output_spec(tools, ToolChoice("required", ("get_weather",)),
                       parse_response_format({"type": "json_object"}),
                       parallel_tool_calls=False)
    assert out.tools == [NESTED] and out.tool_choice == "required"
    assert out.allowed_tools == ("get_weather",) and out.parallel_tool_calls is False
    assert out.response_format == "json_object" and out.json_schema is None
    g = Generate(rid="r", messages=[{"role": "user", "content": "x"}], output=out)
    assert decode_down(encode(g)) == g  # what the worker reads back is what was built
    # Text, no tools: nothing to constrain, every default.
    assert output_spec((), ToolChoice(), ResponseFormat()) == OutputSpec()
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = parse_response_format({"type": "json_schema", "name": "x", "schema": schema})
    out = output_spec((), ToolChoice(), fmt, stop=["s"], logprobs=False, top_logprobs=3)
    assert (out.response_format, out.json_schema) == ("json_schema", schema)
    assert out.stop == ("s",) and out.top_logprobs == 0  # no alternatives without logprobs


def test_server_defaults_fill_only_what_the_request_left_out():
    from supervisor.config import Config

    cfg = Config(default_max_tokens=64, default_temperature=0.3, default_repetition_penalty=1.1)
    s = build.sampling(cfg, fallback_max_tokens=16)
    assert (s.max_tokens, s.temperature, s.repetition_penalty) == (64, 0.3, 1.1)
    s = build.sampling(cfg, fallback_max_tokens=16, max_tokens=5, temperature=0.0,
                       repetition_penalty=1.0, top_k=3, logit_bias={7: -1.0})
    assert (s.max_tokens, s.temperature, s.repetition_penalty) == (5, 0.0, 1.0)
    assert s.top_k == 3 and s.logit_bias == ((7, -1.0),)
    # no server default: the endpoint's own (16 for legacy completions, None for chat)
    assert build.sampling(Config(), fallback_max_tokens=16).max_tokens == 16
    assert build.sampling(Config()) == SamplingParams()


def test_every_surface_builds_one_complete_generate_with_the_server_defaults():
    from supervisor.api.chat.request import parse_chat_request
    from supervisor.api.completions.request import parse_completion_request
    from supervisor.api.responses.request import parse_responses_request
    from supervisor.config import Config

    cfg = Config(default_max_tokens=64, default_temperature=0.3, default_repetition_penalty=1.1)
    chat = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    text = parse_completion_request({"model": "m", "prompt": "x"})
    resp = parse_responses_request({"model": "m", "input": "x"})
    built = [chat.to_generate(cfg), text.to_generate(cfg),
             resp.to_generate(resp.input_items, cfg, "resp_1")]
    for g in built:
        assert isinstance(g, Generate) and g.rid == ""  # the dispatcher stamps it
        assert (g.sampling.max_tokens, g.sampling.temperature,
                g.sampling.repetition_penalty) == (64, 0.3, 1.1)
        assert decode_down(encode(g)) == g
    assert built[0].messages == built[2].messages == [{"role": "user", "content": "x"}]
    assert built[1].prompt == "x" and built[1].messages is None
    # Without server defaults: legacy completions' own 16; chat and Responses none.
    assert text.to_generate(Config()).sampling.max_tokens == 16
    assert chat.to_generate(Config()).sampling == SamplingParams()
    assert resp.to_generate(resp.input_items, Config(), "resp_1").sampling == SamplingParams()
