"""POST /v1/responses sampling fields that chat completions also takes: presence_penalty,
frequency_penalty and top_logprobs (with `include: ["message.output_text.logprobs"]`).
They are read with chat's field rules (api/fields/params.py), reach the worker in the
Generate (SamplingParams, OutputSpec), are echoed with the request's values, and the
logprobs appear where OpenAI's spec puts them: on each `response.output_text.delta`, on
`response.output_text.done` and on the output_text part."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from protocol import Done, FinishReason
from supervisor.api.output import Part, TokenLogprob
from supervisor.api.responses.builder import ResponseBuilder, replay
from supervisor.api.responses.request import LOGPROBS, parse_responses_request
from supervisor.api.responses.runs import Run
from supervisor.http.errors import APIError
from tests.openresponses.schema import check_event, check_response
from tests.supervisor.test_responses_objects import FakeGeneration

CONFIG = SimpleNamespace(default_max_tokens=None, default_temperature=None,
                         default_repetition_penalty=None, allowed_media_dirs=())


def req(**kw):
    return parse_responses_request({"model": "m", "input": "hi", **kw})


def test_penalties_and_logprobs_reach_the_worker_and_are_echoed():
    r = req(presence_penalty=0.5, frequency_penalty=-1, top_logprobs=3, include=[LOGPROBS])
    g = r.to_generate(r.input_items, CONFIG, "resp_1")
    assert (g.sampling.presence_penalty, g.sampling.frequency_penalty) == (0.5, -1.0)
    assert (g.output.logprobs, g.output.top_logprobs) == (True, 3)
    echo = ResponseBuilder(r, "m").response()
    check_response(echo)  # both schemas
    assert (echo["presence_penalty"], echo["frequency_penalty"], echo["top_logprobs"]) == (
        0.5, -1.0, 3)


def test_without_include_no_logprobs_are_computed():
    r = req(top_logprobs=2, include=["reasoning.encrypted_content"])
    g = r.to_generate(r.input_items, CONFIG, "resp_1")
    assert (g.output.logprobs, g.output.top_logprobs) == (False, 0)
    assert g.sampling.presence_penalty is None and g.sampling.frequency_penalty is None
    echo = ResponseBuilder(req(), "m").response()
    assert (echo["presence_penalty"], echo["frequency_penalty"], echo["top_logprobs"]) == (
        0.0, 0.0, 0)


@pytest.mark.parametrize("body,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 1.5}, "top_logprobs"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"include": [3]}, "include[0]"),
])
def test_bad_values_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        req(**body)
    assert e.value.status == 400 and e.value.param == param


def lp(token: str, value: float) -> TokenLogprob:
    raw = list(token.encode())
    return TokenLogprob(token, value, raw, [(token, value, raw), ("x", -3.0, [120])])


def test_logprobs_on_the_deltas_the_done_event_and_the_part():
    parts = [Part(text="He", tokens=1, logprobs=[lp("He", -0.5)]),
             Part(text="", tokens=1, logprobs=[lp("\ufffd", -0.25)]),  # half a character
             Part(text="llo\u00e9", tokens=1, logprobs=[lp("llo", -1.0)])]
    done = Done(epoch=1, rid="r", finish_reason=FinishReason.STOP, prompt_tokens=3,
                completion_tokens=3)
    run = Run(ResponseBuilder(req(include=[LOGPROBS], top_logprobs=2), "m"),
              FakeGeneration(parts, done), None, [])

    async def go():
        await run.wait_started()
        await run.generate()
    asyncio.run(go())
    for ev in run.events:
        check_event(ev)  # both schemas
    deltas = [e for e in run.events if e["type"] == "response.output_text.delta"]
    assert [[t["token"] for t in d["logprobs"]] for d in deltas] == [["He"], ["\ufffd", "llo"]]
    assert deltas[0]["logprobs"][0] == {
        "token": "He", "logprob": -0.5, "bytes": [72, 101],
        "top_logprobs": [{"token": "He", "logprob": -0.5, "bytes": [72, 101]},
                         {"token": "x", "logprob": -3.0, "bytes": [120]}]}
    (text_done,) = [e for e in run.events if e["type"] == "response.output_text.done"]
    part = run.builder.response()["output"][0]["content"][0]
    assert text_done["logprobs"] == part["logprobs"]
    assert [t["logprob"] for t in part["logprobs"]] == [-0.5, -0.25, -1.0]
    # The part as first announced held none: events do not change after they are sent.
    (added,) = [e for e in run.events if e["type"] == "response.content_part.added"]
    assert added["part"]["logprobs"] == []
    # Replayed from the stored object: the same logprobs, in one delta.
    again = replay(run.builder.response())
    for ev in again:
        check_event(ev)
    (delta,) = [e for e in again if e["type"] == "response.output_text.delta"]
    (done,) = [e for e in again if e["type"] == "response.output_text.done"]
    assert delta["logprobs"] == done["logprobs"] == part["logprobs"]
