"""Tool-call parsing per family: each family's real call text, fed to the output splitter
in one piece and split at every position, gives the same calls and never leaks markup."""

from __future__ import annotations

import json

import pytest

from worker.text.channels import OutputSplitter
from worker.text.tool_formats import LLAMA3_JSON, mlx_lm_format, normalize_calls

WEATHER = {"city": "Paris", "days": 3}
TIME = {"zone": "UTC"}

# family → (format, the model's output, expected calls, expected answer text)
FIXTURES = {
    "hermes_qwen": (
        mlx_lm_format("json_tools"),
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "UTC"}}\n</tool_call>',
        [("get_weather", WEATHER), ("get_time", TIME)], "Let me check.\n"),
    "qwen3_coder": (
        mlx_lm_format("qwen3_coder"),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        [("get_weather", WEATHER)], ""),
    "mistral": (
        mlx_lm_format("mistral", "[TOOL_CALLS]{{ name }}[ARGS]"),
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
        '{"zone": "UTC"}',
        [("get_weather", WEATHER), ("get_time", TIME)], ""),
    "mistral_json_list": (
        mlx_lm_format("mistral"),
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        [("get_weather", WEATHER)], ""),
    "llama3_json": (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        [("get_weather", WEATHER)], ""),
    "gemma": (
        mlx_lm_format("function_gemma"),
        "Sure. <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}"
        "<end_function_call>",
        [("get_weather", WEATHER)], "Sure. "),
    "gemma4": (
        mlx_lm_format("gemma4"),
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        [("get_weather", WEATHER)], ""),
    "pythonic": (
        mlx_lm_format("pythonic"),
        '<|tool_call_start|>[get_weather(city="Paris", days=3), get_time(zone="UTC")]'
        "<|tool_call_end|>Done.",
        [("get_weather", WEATHER), ("get_time", TIME)], "Done."),
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]


class Tok:
    """The tokenizer attributes the splitter reads (thinking markers)."""
    has_thinking = True
    think_start, think_end = "<think>", "</think>"


def run(fmt, pieces, initial="normal"):
    s = OutputSplitter(Tok(), fmt, TOOLS, initial)
    content, reasoning, calls = "", "", []
    for p in pieces:
        c, r, k = s.feed(p)
        content, reasoning, calls = content + c, reasoning + r, calls + list(k)
    c, r, k = s.finish()
    return content + c, reasoning + r, calls + list(k)


def check(calls, expected):
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert [c.index for c in calls] == list(range(len(expected)))
    assert len({c.id for c in calls}) == len(calls) and all(c.id for c in calls)


@pytest.mark.parametrize("family", sorted(FIXTURES))
def test_family_call_parses_whole(family):
    fmt, text, expected, answer = FIXTURES[family]
    content, reasoning, calls = run(fmt, [text])
    check(calls, expected)
    assert content == answer and reasoning == ""


@pytest.mark.parametrize("family", sorted(FIXTURES))
def test_family_call_parses_split_at_every_position(family):
    fmt, text, expected, answer = FIXTURES[family]
    for i in range(1, len(text)):
        content, _, calls = run(fmt, [text[:i], text[i:]])
        check(calls, expected)
        assert content == answer, (i, content)
    # and one character at a time, as a stream of tiny tokens would come
    content, _, calls = run(fmt, list(text))
    check(calls, expected)
    assert content == answer


def test_markup_never_leaks_and_text_after_a_call_resumes():
    fmt = mlx_lm_format("json_tools")
    text = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nThe time is '
            "now.")
    for i in range(len(text)):
        content, _, calls = run(fmt, [text[:i], text[i:]])
        assert "<tool_call" not in content and "</tool_call" not in content
        assert content == "\nThe time is now."
        check(calls, [("get_time", {})])


def test_reasoning_is_split_from_the_answer_at_every_position():
    fmt = mlx_lm_format("json_tools")
    text = "<think>\nthe user wants weather\n</think>\n\nIt is sunny."
    for i in range(len(text)):
        content, reasoning, calls = run(fmt, [text[:i], text[i:]])
        assert reasoning == "\nthe user wants weather\n"
        assert content == "\n\nIt is sunny." and calls == []
    # A template that opened the think block: the output starts as reasoning.
    content, reasoning, _ = run(fmt, ["plan", " more</think>answer"], initial="reasoning")
    assert (reasoning, content) == ("plan more", "answer")
    # ...and the model writes its own opening tag as well: markup, not reasoning.
    text = "<think>\nplan</think>answer"
    for i in range(len(text)):
        content, reasoning, _ = run(fmt, [text[:i], text[i:]], initial="reasoning")
        assert (reasoning, content) == ("\nplan", "answer"), i


def test_without_a_format_markup_is_plain_text():
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, _, calls = run(None, [text])
    assert content == text and calls == []


def test_unparseable_or_unfinished_calls_are_dropped_not_leaked():
    fmt = mlx_lm_format("json_tools")
    content, _, calls = run(fmt, ["A<tool_call>\n{not json}\n</tool_call>B"])
    assert (content, calls) == ("AB", [])
    content, _, calls = run(fmt, ['A<tool_call>\n{"name": "get_ti'])  # cut off by max_tokens
    assert (content, calls) == ("A", [])


def test_llama3_plain_answers_stay_text():
    content, _, calls = run(LLAMA3_JSON, ["Hello ", "there"])
    assert (content, calls) == ("Hello there", [])
    content, _, calls = run(LLAMA3_JSON, ["{not a call"])
    assert (content, calls) == ("{not a call", [])


def test_normalize_calls_rejects_junk():
    assert normalize_calls({"name": "f", "arguments": '{"a": 1}'}) == [
        {"name": "f", "arguments": '{"a":1}', "id": None}]
    for bad in ({"arguments": {}}, {"name": "f", "arguments": "[1]"}, "text"):
        with pytest.raises((ValueError, TypeError)):
            normalize_calls(bad)


# The model's JSON arguments leave exactly as written: spacing, key order, number spelling.
AS_WRITTEN = '{"when": 1.50e1,  "city":"Paris", "nested": {"z": [1.0, -0E0]}}'
VERBATIM = {
    "hermes_qwen": (mlx_lm_format("json_tools"),
                    f'<tool_call>\n{{"name": "get_weather", "arguments": {AS_WRITTEN}}}\n'
                    "</tool_call>"),
    "mistral": (mlx_lm_format("mistral", "[ARGS]"),
                f"[TOOL_CALLS]get_weather[ARGS]{AS_WRITTEN}"),
    "mistral_json_list": (mlx_lm_format("mistral"),
                          f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {AS_WRITTEN}}}]'),
    "llama3_json": (LLAMA3_JSON, f'{{"name": "get_weather", "parameters": {AS_WRITTEN}}}'),
}


@pytest.mark.parametrize("family", sorted(VERBATIM))
def test_json_arguments_leave_as_the_model_wrote_them(family):
    fmt, text = VERBATIM[family]
    _, _, calls = run(fmt, [text])
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", AS_WRITTEN)]


def test_parallel_json_calls_each_keep_their_own_text():
    fmt = mlx_lm_format("mistral", "[ARGS]")
    _, _, calls = run(fmt, ['[TOOL_CALLS]get_time[ARGS]{"zone":"UTC"}'
                            '[TOOL_CALLS]get_time[ARGS]{ "zone" : "UTC" }'])
    assert [c.arguments for c in calls] == ['{"zone":"UTC"}', '{ "zone" : "UTC" }']


def test_arguments_of_formats_that_are_not_json_are_compact_json():
    _, _, calls = run(FIXTURES["pythonic"][0], ['<|tool_call_start|>[get_weather(city="Paris", '
                                                'days=3)]<|tool_call_end|>'])
    assert calls[0].arguments == '{"city":"Paris","days":3}'


# Numbers no strict JSON parser takes back (Python reads 1e999 as inf and would write
# `Infinity`): such a call is dropped like any other that does not parse.
NOT_FINITE = {
    "json 1e999": (mlx_lm_format("json_tools"),
                   '<tool_call>\n{"name": "get_weather", "arguments": {"days": 1e999}}\n'
                   "</tool_call>"),
    "json NaN": (mlx_lm_format("json_tools"),
                 '<tool_call>\n{"name": "get_weather", "arguments": {"days": NaN}}\n</tool_call>'),
    "json -Infinity": (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"days": -Infinity}}'),
    "json huge integer": (mlx_lm_format("json_tools"),
                          '<tool_call>\n{"name": "get_weather", "arguments": {"days": 1'
                          + "0" * 400 + "}}\n</tool_call>"),
    "pythonic 1e999": (FIXTURES["pythonic"][0],
                       "<|tool_call_start|>[get_weather(days=1e999)]<|tool_call_end|>"),
    "qwen3_coder 1e999": (mlx_lm_format("qwen3_coder"),
                          "<tool_call>\n<function=get_weather>\n<parameter=days>\n1e999\n"
                          "</parameter>\n</function>\n</tool_call>"),
}


@pytest.mark.parametrize("case", sorted(NOT_FINITE))
def test_a_call_with_a_number_beyond_a_double_is_dropped(case):
    fmt, text = NOT_FINITE[case]
    content, _, calls = run(fmt, [text])
    assert calls == []
    assert content == ("" if fmt.start else text)  # Llama 3: an answer, not a call
