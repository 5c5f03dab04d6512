"""Content parts count against the request limits before any of them is parsed.

An outside tester sent one Anthropic user message of 270,000 tool_result blocks (16 MB):
MAX_MESSAGES counted one message, every block was then parsed and templated, the refusal
took 24 s and a concurrent 2-token chat waited behind it. Each surface that takes content
arrays (chat parts, Anthropic blocks and a tool result's own blocks, Responses parts)
counts them all first.
"""

from __future__ import annotations

import pytest

from supervisor.api.fields import limits
from supervisor.http.errors import APIError
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for

N = limits.MAX_PARTS


def text_parts(n: int, kind: str = "text") -> list[dict]:
    return [{"type": kind, "text": "x"}] * n


def tool_results(n: int) -> list[dict]:
    return [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok"} for i in range(n)]


@pytest.mark.parametrize("messages,over", [
    ([{"role": "user", "content": text_parts(N)}], False),
    ([{"role": "user", "content": text_parts(N + 1)}], True),
    ([{"role": "user", "content": text_parts(N // 2)}] * 2, False),
    ([{"role": "user", "content": text_parts(N // 2)}] * 2
     + [{"role": "user", "content": text_parts(1)}], True),
    # a tool result's own blocks count too
    ([{"role": "user", "content": [{"type": "tool_result", "content": text_parts(N)}]}], True),
    ([{"role": "user", "content": [{"type": "tool_result", "content": text_parts(N - 1)}]}],
     False),
    ([{"role": "user", "content": "a string is one part"}] * 3 + ["not an object"], False),
])
def test_check_parts_counts_every_part(messages, over):
    if over:
        with pytest.raises(APIError) as err:
            limits.check_parts("messages", messages)
        assert err.value.status == 400 and err.value.code == "array_above_max_length"
        assert str(N) in err.value.message
    else:
        limits.check_parts("messages", messages)


SURFACES = [
    ("/v1/chat/completions", lambda n: {"model": "fake", "messages": [
        {"role": "user", "content": text_parts(n)}]}, "messages"),
    ("/v1/responses", lambda n: {"model": "fake", "input": [
        {"role": "user", "content": text_parts(n, "input_text")}]}, "input"),
    ("/v1/messages", lambda n: {"model": "fake", "max_tokens": 4, "messages": [
        {"role": "user", "content": tool_results(n)}]}, "messages"),
]


@pytest.mark.parametrize("route,body,param", SURFACES, ids=[s[0] for s in SURFACES])
async def test_each_surface_refuses_too_many_parts_in_its_envelope(route, body, param):
    client = await client_for(FakeWorld(FakeBehaviour()), max_body_bytes=64 << 20)
    try:
        r = await client.post(route, json=body(N + 1))
        got = await r.json()
        assert r.status == 400, got
        error = got["error"]
        assert "more than 10000 content parts" in error["message"]
        if route == "/v1/messages":
            assert got["type"] == "error" and error["type"] == "invalid_request_error"
        else:
            assert (error["param"], error["code"]) == (param, "array_above_max_length")
        # the server still serves
        ok = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status == 200
    finally:
        await client.close()


async def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch):
    """Seconds of parsing and checking a body of megabytes must not stall every other
    request (the outside tester's 2-token chat waited 24.5 s behind one): a body over
    INLINE_PARSE_BYTES is parsed on a thread, a small one inline."""
    import threading

    from supervisor.http import errors

    seen = []
    real = errors.first_bad_value

    def spy(body):
        seen.append(threading.current_thread() is threading.main_thread())
        return real(body)

    monkeypatch.setattr(errors, "first_bad_value", spy)
    client = await client_for(FakeWorld(FakeBehaviour()), max_body_bytes=64 << 20)
    try:
        small = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        big = {**small, "metadata": {"pad": "x" * 500}, "user": "u" * errors.INLINE_PARSE_BYTES}
        for body in (small, big):
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status in (200, 400), await r.text()
        assert seen == [True, False]
    finally:
        await client.close()
