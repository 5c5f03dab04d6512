"""Response objects and events complete in every state, against OpenAI's spec AND the
Open Responses one (clients hold a server to either): every required field present
(presence_penalty, frequency_penalty, top_logprobs, service_tier, max_tool_calls,
safety_identifier, usage), and an item the response ended inside never `completed`
unless the response is; a tool call cut off by max_output_tokens still an item, with its
events, live and replayed. The builder directly, and a Run driven by a stand-in for the
lifecycle's Generation (parts, then a Done or an error)."""

from __future__ import annotations

import asyncio

import pytest

from protocol import Done, FinishReason, Started, ToolCall
from supervisor.api.output import Part
from supervisor.api.responses.builder import ResponseBuilder, replay, usage
from supervisor.api.responses.request import parse_responses_request
from supervisor.api.responses.runs import Run
from supervisor.workers.errors import WorkerFailed
from tests.openresponses.schema import check_event, check_response as check_shapes

WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
NEW_FIELDS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0,
              "service_tier": "default", "max_tool_calls": None, "safety_identifier": None}


def req(**kw):
    return parse_responses_request({"model": "m", "input": "hi", **kw})


def check_events(events: list[dict]) -> dict:
    """Every event valid under both schemas, numbered in order; the final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for ev in events:
        check_event(ev)
        if "response" in ev:
            check_response(ev["response"])
    return events[-1]["response"]


def check_response(r: dict) -> None:
    check_shapes(r)
    assert {k: r[k] for k in NEW_FIELDS} == NEW_FIELDS
    assert "usage" in r


def states(builder_events):
    return {e["item"]["id"]: e["item"]["status"] for e in builder_events
            if e["type"] == "response.output_item.done"}


@pytest.mark.parametrize("status,kw,terminal", [
    ("completed", {}, "response.completed"),
    ("incomplete", {"incomplete_reason": "max_output_tokens"}, "response.incomplete"),
    ("failed", {"error": {"code": "server_error", "message": "worker died; retry"}},
     "response.failed"),
    ("cancelled", {}, "response.failed"),
])
def test_every_state_is_complete_under_both_schemas(status, kw, terminal):
    b = ResponseBuilder(req(tools=[WEATHER], tool_choice="auto"), "m")
    events = b.start()
    assert events[0]["response"]["usage"] is None  # known only at the end
    events += b.reasoning("hm") + b.function_call("get_weather", '{"city": "Paris"}')
    events += b.text("partial answ")
    events += b.finish(status, usage=usage(3, 5), **kw)
    final = check_events(events)
    assert events[-1]["type"] == terminal and final["status"] == status
    assert final["usage"]["output_tokens"] == 5
    # The call ended before the response did; the message is the one it ended inside.
    kinds = {o["type"]: o["status"] for o in final["output"]}
    ended_inside = "completed" if status == "completed" else "incomplete"
    assert kinds == {"reasoning": "completed", "function_call": "completed",
                     "message": ended_inside}
    assert states(events)[final["output"][-1]["id"]] == ended_inside
    assert (final["completed_at"] is not None) == (status == "completed")
    # Retold from the store, the same statuses.
    again = replay(final)
    assert check_events(again) == final
    assert states(again) == states(events)


def test_queued_and_a_tool_without_a_description():
    b = ResponseBuilder(req(tools=[WEATHER], background=True), "m")
    events = b.queued()
    queued = check_events(events)
    assert queued["status"] == "queued" and queued["usage"] is None
    assert queued["tools"][0]["description"] is None  # required by Open Responses


def test_a_call_cut_off_is_an_incomplete_item_with_its_events():
    b = ResponseBuilder(req(tools=[WEATHER], tool_choice="required"), "m")
    events = b.start()
    events += b.function_call("get_weather", '{"city": "Par', "call_1", status="incomplete")
    events += b.finish("incomplete", usage=usage(9, 12), incomplete_reason="max_output_tokens")
    final = check_events(events)
    assert [e["type"] for e in events[2:-1]] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    (call,) = final["output"]
    assert (call["status"], call["arguments"], call["call_id"]) == (
        "incomplete", '{"city": "Par', "call_1")
    assert events[-2]["item"]["status"] == "incomplete"
    assert events[2]["item"]["status"] == "in_progress"
    again = replay(final)
    assert check_events(again) == final and states(again) == states(events)


# ---- a Run, as routes.py drives it -----------------------------------------------------

class FakeGeneration:
    """The lifecycle Generation as a Run sees it: started, parts, then done or an error."""

    def __init__(self, parts, done=None, error=None):
        self._parts, self.done, self._error = parts, done, error
        self.handle = self
        self.closed = False

    async def started(self):
        return Started(epoch=1, rid="r", prompt_tokens=7, cached_tokens=2)

    async def parts(self):
        for p in self._parts:
            yield p
        if self._error is not None:
            raise self._error

    def close(self):
        self.closed = True

    def cancel(self):
        pass


def run(request, gen) -> tuple[list, dict]:
    r = Run(ResponseBuilder(request, "m"), gen, None, [])

    async def go():
        await r.wait_started()
        await r.generate()
    asyncio.run(go())
    return r.events, r.builder.response()


def test_a_run_cut_off_inside_a_forced_call_keeps_the_call():
    done = Done(epoch=1, rid="r", finish_reason=FinishReason.LENGTH, prompt_tokens=7,
                completion_tokens=6)
    cut = ToolCall(0, "call_9", "", '{"city": "Pa')  # its name was not read
    events, final = run(req(tools=[WEATHER], tool_choice="required"),
                        FakeGeneration([Part(tokens=6, cut_call=cut)], done))
    check_events(events)
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    (call,) = final["output"]
    # The only tool it could be is named; the arguments are what was generated.
    assert (call["type"], call["status"], call["name"], call["arguments"], call["call_id"]) == (
        "function_call", "incomplete", "get_weather", '{"city": "Pa', "call_9")
    assert [e["type"] for e in events].count("response.function_call_arguments.done") == 1


def test_a_run_that_fails_mid_way_has_usage_and_an_incomplete_message():
    events, final = run(req(), FakeGeneration([Part(text="Hel", tokens=2),
                                               Part(text="lo", tokens=1)],
                                              error=WorkerFailed("the worker died")))
    check_events(events)
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 3
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert [o["status"] for o in final["output"]] == ["incomplete"]


def test_what_is_echoed_not_applied_comes_back_as_sent():
    """max_tool_calls, safety_identifier and text.verbosity: echoed on every event's
    response and on replay (a client reads back what it set), valid under both schemas."""
    b = ResponseBuilder(req(max_tool_calls=3, safety_identifier="user-7f3a",
                            text={"format": {"type": "text"}, "verbosity": "low"}), "m")
    events = b.start() + b.text("ok") + b.finish("completed", usage=usage(1, 1))
    for ev in events:
        if "response" in ev:
            check_shapes(ev["response"])
            assert (ev["response"]["max_tool_calls"], ev["response"]["safety_identifier"],
                    ev["response"]["text"]) == (3, "user-7f3a", {
                        "format": {"type": "text"}, "verbosity": "low"})
    assert replay(events[-1]["response"])[-1]["response"]["text"]["verbosity"] == "low"
    unset = ResponseBuilder(req(), "m").response()
    assert unset["text"]["verbosity"] == "medium"  # OpenAI's default, echoed as it does


@pytest.mark.parametrize("kw,param", [
    ({"max_tool_calls": "3"}, "max_tool_calls"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"safety_identifier": 7}, "safety_identifier"),
    ({"safety_identifier": "x" * 65}, "safety_identifier"),
    ({"text": {"verbosity": "verbose"}}, "text.verbosity"),
])
def test_what_is_echoed_is_still_checked(kw, param):
    from supervisor.http.errors import APIError

    with pytest.raises(APIError) as e:
        req(**kw)
    assert e.value.status == 400 and e.value.param == param
