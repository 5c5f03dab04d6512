"""Anthropic's message threads (supervisor/api/messages/threads.py): the held conversation
a `continue` is served as, the errors a client replays on (with their
`error.details.error_code`), what expires and what a failed turn leaves; the store with an
injected clock, the route over the fake worker."""

from __future__ import annotations

import pytest
from anthropic.types import ThreadAlreadyContinuedErrorDetails, ThreadNotFoundErrorDetails

from protocol import Generate
from supervisor.api.messages.threads import Threads
from supervisor.http.errors import APIError
from tests.anthropic.shapes import validate
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for
from tests.supervisor.test_messages_routes import events_of

SYSTEM = "Be brief."
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]
USER = {"role": "user", "content": "Weather?"}
CALL = [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}]
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                       "content": "21"}]}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def created(threads: Threads, message_id: str = "msg_1", size: int = 100) -> None:
    turn = threads.turn({"model": "m", "system": SYSTEM, "tools": TOOLS, "messages": [USER],
                         "thread": {"type": "create"}}, size)
    turn.record(message_id, CALL)
    turn.close()


def cont(previous: str, **extra) -> dict:
    return {"model": "m", "messages": [RESULT],
            "thread": {"type": "continue", "previous_message_id": previous}, **extra}


def refused(threads: Threads, body: dict, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        threads.turn(body, **kw)
    return e.value


def test_a_continue_is_served_as_the_whole_conversation_and_continues_once():
    threads = Threads(clock=Clock())
    created(threads)
    turn = threads.turn(cont("msg_1", max_tokens=9))
    assert turn.body == {"model": "m", "max_tokens": 9, "system": SYSTEM, "tools": TOOLS,
                         "messages": [USER, {"role": "assistant", "content": CALL}, RESULT]}
    # While it runs, nobody else continues from msg_1...
    err = refused(threads, cont("msg_1"))
    assert (err.status, err.code) == (400, "thread_continue_in_flight")
    # ...but count_tokens reads it.
    assert threads.turn(cont("msg_1"), reserve=False).body["messages"][-1] == RESULT
    turn.record("msg_2", [{"type": "text", "text": "21 degrees"}])
    turn.close()
    err = refused(threads, cont("msg_1"))
    assert (err.status, err.code) == (400, "thread_already_continued")
    again = threads.turn(cont("msg_2"))
    assert [m["role"] for m in again.body["messages"]] == ["user", "assistant", "user",
                                                           "assistant", "user"]
    assert again.body["system"] == SYSTEM and again.body["tools"] == TOOLS


def test_a_failed_turn_leaves_its_predecessor_continuable():
    threads = Threads(clock=Clock())
    created(threads)
    threads.turn(cont("msg_1")).close()          # e.g. the model's context was too small
    turn = threads.turn(cont("msg_1"))
    assert turn.body["messages"][-1] == RESULT


def test_unknown_idle_and_crowded_out_threads_are_not_found():
    clock = Clock()
    threads = Threads(clock=clock, idle_s=300)
    err = refused(threads, cont("msg_never"))
    assert (err.status, err.code) == (404, "thread_not_found")
    created(threads, "msg_a")
    clock.now += 301
    assert refused(threads, cont("msg_a")).code == "thread_not_found"
    created(threads, "msg_b")
    threads.max_bytes = 2 * threads.bytes + 1    # room for two conversations like it
    clock.now += 200
    created(threads, "msg_c")
    threads.turn(cont("msg_b"), reserve=False)   # reading it makes it the most recent
    created(threads, "msg_d")                    # three are too many: msg_c goes
    assert refused(threads, cont("msg_c")).code == "thread_not_found"
    assert threads.turn(cont("msg_b")).body["messages"][-1] == RESULT
    assert threads.turn(cont("msg_d")).body["system"] == SYSTEM


def test_a_continue_leaves_system_and_tools_to_the_thread():
    threads = Threads(clock=Clock())
    created(threads)
    for name, value in (("system", SYSTEM), ("tools", TOOLS)):
        err = refused(threads, cont("msg_1", **{name: value}))
        assert (err.status, err.param) == (400, name)
    assert threads.turn(cont("msg_1")).body["system"] == SYSTEM   # still there to continue


@pytest.mark.parametrize("thread, param", [
    ("create", "thread"), ({"type": "fork"}, "thread.type"), ({}, "thread.type"),
    ({"type": "continue"}, "thread.previous_message_id"),
    ({"type": "continue", "previous_message_id": 7}, "thread.previous_message_id"),
])
def test_a_malformed_thread_is_a_400_naming_it(thread, param):
    err = refused(Threads(), {"model": "m", "messages": [USER], "thread": thread})
    assert (err.status, err.param) == (400, param)


def test_without_a_thread_nothing_is_held():
    threads = Threads()
    turn = threads.turn({"model": "m", "messages": [USER]})
    turn.record("msg_1", CALL)
    assert not threads.held and refused(threads, cont("msg_1")).code == "thread_not_found"


BODY = {"model": "fake", "max_tokens": 3, "system": SYSTEM, "messages": [USER]}
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "message-threads-2026-08-12"}


def sent(world: FakeWorld) -> list[Generate]:
    return [m for m in world.received if isinstance(m, Generate)]


@pytest.mark.parametrize("stream", [False, True])
async def test_over_http_a_continue_reaches_the_worker_whole(stream):
    world = FakeWorld(FakeBehaviour(tokens=3))
    client = await client_for(world)
    try:
        r = await client.post("/v1/messages", headers=HEADERS, json={
            **BODY, "stream": stream, "thread": {"type": "create"}})
        assert r.status == 200
        first = (events_of(await r.text())[0][1]["message"]["id"] if stream
                 else (await r.json())["id"])
        follow = {"role": "user", "content": "more"}
        # count_tokens reads the thread (the worker tokenizes the whole conversation)
        # without taking its turn.
        r = await client.post("/v1/messages/count_tokens", headers=HEADERS, json={
            "model": "fake", "messages": [follow],
            "thread": {"type": "continue", "previous_message_id": first}})
        assert r.status == 200 and len(sent(world)[-1].messages) == 4
        r = await client.post("/v1/messages", headers=HEADERS, json={
            "model": "fake", "max_tokens": 3, "messages": [follow],
            "thread": {"type": "continue", "previous_message_id": first}})
        body = await r.json()
        assert r.status == 200, body
        validate(body, "Message")
        whole = sent(world)[-1].messages
        assert whole == [{"role": "system", "content": SYSTEM}, USER,
                         {"role": "assistant", "content": "w1 w2 w3 "}, follow]
        # The same reply continued again: the client is told so, in Anthropic's envelope.
        r = await client.post("/v1/messages", headers=HEADERS, json={
            "model": "fake", "max_tokens": 3, "messages": [follow],
            "thread": {"type": "continue", "previous_message_id": first}})
        err = await r.json()
        assert r.status == 400 and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["details"] == {"error_code": "thread_already_continued"}
        ThreadAlreadyContinuedErrorDetails.model_validate(err["error"]["details"])
        r = await client.post("/v1/messages", headers=HEADERS, json={
            "model": "fake", "max_tokens": 3, "messages": [follow],
            "thread": {"type": "continue", "previous_message_id": "msg_gone"}})
        err = await r.json()
        assert r.status == 404 and err["error"]["type"] == "not_found_error"
        ThreadNotFoundErrorDetails.model_validate(err["error"]["details"])
    finally:
        await client.close()
