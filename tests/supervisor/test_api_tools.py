"""Tools, tool_choice and response_format validation (shared by chat and Responses)."""

from __future__ import annotations

import pytest

from protocol.messages import Generate
from supervisor.api.parse.tools import (ResponseFormat, ToolChoice, generate_fields, normalize_tools,
                                  parse_response_format, parse_tool_choice)
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


def test_generate_fields_make_a_valid_generate():
    tools = normalize_tools([FLAT])
    fields = generate_fields(tools, ToolChoice("required", ("get_weather",)),
                             parse_response_format({"type": "json_object"}), False)
    g = Generate(rid="r", messages=[{"role": "user", "content": "x"}], **fields)
    assert g.tools == [NESTED] and g.tool_choice == "required"
    assert g.allowed_tools == ["get_weather"] and g.parallel_tool_calls is False
    assert g.response_format == "json_object" and g.json_schema is None
    none = generate_fields((), ToolChoice(), ResponseFormat())
    assert none["tools"] is None and none["tool_choice"] is None and none["response_format"] is None


def test_server_defaults_fill_only_what_the_request_left_out():
    from supervisor.api.generation import apply_defaults
    from supervisor.config import Config

    cfg = Config(default_max_tokens=64, default_temperature=0.3, default_repetition_penalty=1.1)
    fields = apply_defaults({"max_tokens": None, "temperature": None,
                             "repetition_penalty": None}, cfg, 16)
    assert fields == {"max_tokens": 64, "temperature": 0.3, "repetition_penalty": 1.1}
    given = {"max_tokens": 5, "temperature": 0.0, "repetition_penalty": 1.0}
    assert apply_defaults(dict(given), cfg, 16) == given
    # no server default: the endpoint's own (16 for legacy completions, None for chat)
    assert apply_defaults({"max_tokens": None}, Config(), 16)["max_tokens"] == 16
    assert apply_defaults({"max_tokens": None}, Config())["max_tokens"] is None
