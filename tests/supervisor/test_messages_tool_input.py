"""Anthropic's tool_use input (supervisor/api/messages): the streamed `input_json_delta`s
are the worker's argument text as the model wrote it, and no surface writes `Infinity` or
`NaN` (a strict client's JSON parser refuses both) even if such text reached it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from protocol.messages import ToolCall
from supervisor.api.messages import shapes
from supervisor.api.messages.stream import BlockWriter


def streamed_input(arguments: str) -> str:
    call = ToolCall(0, "call_1", "f", arguments)
    events = BlockWriter().part(SimpleNamespace(reasoning="", text="", tool_calls=[call]))
    datas = [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    return "".join(d["delta"]["partial_json"] for d in datas
                   if d["type"] == "content_block_delta")


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
