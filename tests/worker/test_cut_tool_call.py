"""A tool call the output ran out of tokens inside (max_tokens) is not a call, but it is
what the tokens were spent on: the splitter keeps what can be read of it (`cut_call`,
which the Responses API shows as an incomplete function_call item), for every family
whose format closes its calls; without `cut` (the model stopped) it is dropped as before."""

from __future__ import annotations

import pytest

from protocol import Delta, ToolCall
from protocol.codec import decode_up, encode
from tests.worker.test_worker_tool_parsing import FIXTURES, TOOLS, Tok
from worker.text.channels import OutputSplitter
from worker.text.tool_formats import mlx_lm_format

# family → (the text up to where max_tokens cut it, the name and arguments that survive)
CUTS = {
    "hermes_qwen": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Par', "get_weather", '{"city": "Par'),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                    "get_weather", ""),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "P', "get_weather", '{"city": "P'),
    "mistral_json_list": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "P',
                          "get_weather", '{"city": "P'),
    "gemma": ("Sure. <start_function_call>call:get_weather{city:<escape>Par",
              "get_weather", ""),
    "pythonic": ('<|tool_call_start|>[get_weather(city="Par', "get_weather", ""),
}


def finish(fmt, text: str, cut: bool):
    s = OutputSplitter(Tok(), fmt, TOOLS)
    content, _, calls = s.feed(text)
    c, _, k = s.finish(cut=cut)
    return content + c, list(calls) + list(k), s.cut_call


@pytest.mark.parametrize("family", sorted(CUTS))
def test_a_call_cut_off_keeps_its_name_and_arguments_so_far(family):
    fmt = FIXTURES[family][0]
    text, name, arguments = CUTS[family]
    content, calls, cut = finish(fmt, text, cut=True)
    assert calls == [] and "tool_call" not in content  # still no call, no markup
    assert (cut.name, cut.arguments) == (name, arguments)
    assert cut.index == 0 and cut.id.startswith("call_")
    # The model itself stopped there (EOS): nothing to show, as before.
    assert finish(fmt, text, cut=False)[2] is None


def test_a_cut_before_the_name_and_after_whole_calls():
    fmt = mlx_lm_format("json_tools")
    _, _, cut = finish(fmt, "<tool_call>", cut=True)  # only the opening marker
    assert (cut.name, cut.arguments) == ("", "")
    _, calls, cut = finish(fmt, '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                '</tool_call>\n<tool_call>\n{"name": "get_weather", "argu',
                           cut=True)
    assert [c.name for c in calls] == ["get_time"]
    assert (cut.index, cut.name, cut.arguments) == (1, "get_weather", "")
    # Cut in the answer after a whole call: no cut call.
    _, calls, cut = finish(fmt, '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                "</tool_call>\nThe ti", cut=True)
    assert len(calls) == 1 and cut is None


def test_the_cut_call_travels_in_the_last_delta():
    d = Delta(epoch=1, rid="r", text="", cut=ToolCall(0, "call_1", "f", '{"a": "b'))
    assert decode_up(encode(d)).cut == ToolCall(0, "call_1", "f", '{"a": "b')
    assert decode_up(encode(Delta(epoch=1, rid="r", text="x"))).cut is None
