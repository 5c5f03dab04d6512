"""Responses that do not complete, through the official `openai` SDK against real
processes: a forced tool call cut off by max_output_tokens is still an output item
(`incomplete`, its arguments so far) with its events, streamed and not; a background
response the worker refuses ends `failed` with usage, retrieved and replayed as a stream.
Every object and event is checked against OpenAI's spec and the Open Responses one."""

from __future__ import annotations

import time

import openai
import pytest

from tests.integration.test_responses_tools import NO_THINKING, WEATHER
from tests.openresponses.schema import check_event, check_response

FORCED = dict(input="Weather in Paris?", temperature=0, tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"},
              parallel_tool_calls=False, reasoning=NO_THINKING)


@pytest.fixture(scope="module")
def qwen_client(qwen_server, family_model):
    return (openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0),
            str(family_model("qwen")))


@pytest.fixture(scope="module")
def whole(qwen_client):
    """The call made with room to finish (greedy, so a cut one is a prefix of it), and a
    budget that ends a few tokens before its end: inside its arguments."""
    client, model = qwen_client
    r = client.responses.create(model=model, max_output_tokens=200, **FORCED)
    (call,) = r.output
    assert call.status == "completed" and r.usage.output_tokens > 8
    return call, r.usage.output_tokens - 4


def _cut_call(response, whole) -> dict:
    check_response(response.model_dump(exclude_unset=True))
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    (call,) = response.output
    assert call.type == "function_call" and call.status == "incomplete"
    assert call.name == "get_weather" and call.call_id
    # What was generated of the arguments: a strict prefix of the whole call's.
    full = whole[0].arguments
    assert call.arguments and full.startswith(call.arguments) and call.arguments != full
    return call


def test_a_forced_call_cut_off_is_an_incomplete_item(qwen_client, whole):
    client, model = qwen_client
    r = client.responses.create(model=model, max_output_tokens=whole[1], **FORCED)
    _cut_call(r, whole)
    assert r.usage.output_tokens == whole[1]
    # Stored as it was, and retold with the same item as a stream.
    again = client.responses.retrieve(r.id)
    assert again.output[0].status == "incomplete"
    replayed = list(client.responses.retrieve(r.id, stream=True))
    for ev in replayed:
        check_event(ev.model_dump(exclude_unset=True))
    assert replayed[-1].response.output == r.output


def test_a_forced_call_cut_off_streams_its_item_events(qwen_client, whole):
    client, model = qwen_client
    events = list(client.responses.create(model=model, max_output_tokens=whole[1], stream=True,
                                          **FORCED))
    for ev in events:
        check_event(ev.model_dump(exclude_unset=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.incomplete"]
    call = _cut_call(events[-1].response, whole)
    assert events[3].delta == events[4].arguments == call.arguments
    assert events[5].item.status == "incomplete" and events[2].item.status == "in_progress"


def test_a_background_response_that_fails_has_usage_and_replays(client, model_id):
    queued = client.responses.create(model=model_id, input="word " * 6000, background=True,
                                     max_output_tokens=4)
    check_response(queued.model_dump(exclude_unset=True))
    deadline = time.monotonic() + 30
    while (r := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    check_response(r.model_dump(exclude_unset=True))
    assert r.status == "failed" and r.error.code == "invalid_prompt"
    assert r.usage.output_tokens == 0 and r.output == []
    events = list(client.responses.retrieve(r.id, stream=True))
    for ev in events:
        check_event(ev.model_dump(exclude_unset=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress",
                                        "response.failed"]
    assert events[-1].response.error.code == "invalid_prompt"
