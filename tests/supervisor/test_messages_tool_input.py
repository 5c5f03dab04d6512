"""Anthropic's tool_use input (supervisor/api/messages): the streamed `input_json_delta`s
are the worker's argument text as the model wrote it, and no surface writes `Infinity` or
`NaN` (a strict client's JSON parser refuses both) even if such text reached it; a call
cut off by max_tokens is the last block, its input what was written of it."""

from __future__ import annotations

import json

import pytest

from protocol.messages import ToolCall
from supervisor.api.messages import shapes
from supervisor.api.messages.stream import BlockWriter
from supervisor.api.output import Output, Part


def streamed_input(arguments: str) -> str:
    call = ToolCall(0, "call_1", "f", arguments)
    return _partial_json(BlockWriter().part(Part(tool_calls=[call])))


def _partial_json(events) -> str:
    datas = [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    return "".join(d["delta"]["partial_json"] for d in datas
                   if d["type"] == "content_block_delta"
                   and d["delta"]["type"] == "input_json_delta")


def test_streamed_input_is_the_models_text():
    written = '{"when": 1.50e1,  "city":"Paris", "tags": ["a"]}'
    assert streamed_input(written) == written
    assert streamed_input("[1]") == "{}"  # not an object: no input


@pytest.mark.parametrize("arguments", ['{"d": 1e999}', '{"d": NaN}', '{"d": -Infinity}'])
def test_non_finite_arguments_never_become_infinity(arguments):
    assert streamed_input(arguments) == "{}"
    blocks = shapes.content(None, "", [ToolCall(0, "call_1", "f", arguments)])
    assert blocks[0]["input"] == {}
    json.dumps(blocks, allow_nan=False)  # what a strict parser would refuse raises here


CUT = '{"city": "Paris", "note": "sunny and w'


@pytest.mark.parametrize("name,only,expected", [
    ("get_weather", "", "get_weather"),     # its own name
    ("", "get_weather", "get_weather"),     # cut before its name: the one tool it can be
    ("", "", None),                         # no name to give it: no block
])
def test_a_cut_call_is_the_last_block_with_what_was_written(name, only, expected):
    cut = ToolCall(1, "call_2", name, CUT)
    done = ToolCall(0, "call_1", "get_time", '{"zone": "UTC"}')
    out = Output()
    out.add(Part(text="Checking.", tool_calls=[done]))
    out.add(Part(cut_call=cut))
    blocks = shapes.content(None, out.content, out.tool_calls, shapes.named(out.cut_call, only))
    writer = BlockWriter(only)
    events = writer.part(Part(text="Checking.", tool_calls=[done])) + writer.part(
        Part(cut_call=cut)) + writer.finish()
    assert writer.blocks == blocks  # streamed or whole, the same content
    if expected is None:
        assert [b["type"] for b in blocks] == ["text", "tool_use"]
        return
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"]
    # The string cut inside is left out, as Anthropic's SDK reads a partial input.
    assert blocks[-1] == {"type": "tool_use", "id": "call_2", "name": expected,
                          "input": {"city": "Paris"}}
    # Streamed: the model's text as written (the SDK parses it partially itself).
    assert _partial_json(events).endswith(CUT)


def test_a_cut_call_with_nothing_readable_has_an_empty_input():
    for written in ("", '{"ci', "[1, 2", "not json"):
        assert shapes.cut_input(written) == {}


@pytest.mark.parametrize("finish,prompt,completion,stop", [
    ("length", 90, 10, "model_context_window_exceeded"),  # the window (100) is full
    ("length", 50, 10, "max_tokens"),                     # the client's max_tokens
    ("stop", 90, 10, "end_turn"),
    ("tool_calls", 90, 10, "tool_use"),
])
def test_a_length_stop_that_filled_the_window_says_so(finish, prompt, completion, stop):
    from protocol import Done, FinishReason

    done = Done(epoch=1, rid="r", finish_reason=FinishReason(finish), prompt_tokens=prompt,
                completion_tokens=completion)
    assert shapes.stop_reason(done, window=100) == stop
    assert shapes.stop_reason(done) in (stop, "max_tokens")  # no window known: max_tokens
