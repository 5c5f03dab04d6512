"""/v1/messages over HTTP against the fake worker: the message and every stream event in
Anthropic's shapes (tests/anthropic/shapes.json), errors in Anthropic's envelope on its
routes (a failure mid-stream included) and OpenAI's everywhere else."""

from __future__ import annotations

import json

from tests.anthropic.shapes import validate, validate_event
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for

BODY = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "some-future-feature"}


def events_of(raw: str) -> list[tuple[str, dict]]:
    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_a_message_and_its_usage():
    client = await client_for(FakeWorld(FakeBehaviour(tokens=3)))
    try:
        r = await client.post("/v1/messages", json=BODY, headers=HEADERS)
        body = await r.json()
        assert r.status == 200, body
        validate(body, "Message")
        assert body["content"] == [{"type": "text", "text": "w1 w2 w3 "}]
        assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
        assert body["usage"]["output_tokens"] == 3 and body["id"].startswith("msg_")
        assert r.headers["request-id"]
        r = await client.post("/v1/messages", json={**BODY, "max_tokens": 2})
        assert (await r.json())["stop_reason"] == "max_tokens"
    finally:
        await client.close()


async def test_the_stream_is_anthropics_event_sequence():
    client = await client_for(FakeWorld(FakeBehaviour(tokens=3)))
    try:
        r = await client.post("/v1/messages", json={**BODY, "stream": True}, headers=HEADERS)
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = events_of(await r.text())
        for name, data in events:
            validate_event(name, data)
        names = [n for n, _ in events]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
        text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
        assert text == "w1 w2 w3 "
        delta = events[-2][1]
        assert delta["delta"]["stop_reason"] == "end_turn" and delta["usage"]["output_tokens"] == 3
    finally:
        await client.close()


async def test_errors_on_these_routes_are_anthropics_and_elsewhere_openais():
    client = await client_for(FakeWorld(FakeBehaviour()))
    try:
        cases = [
            (await client.post("/v1/messages", json={**BODY, "max_tokens": None}), 400,
             "invalid_request_error"),
            (await client.post("/v1/messages", json={**BODY, "model": "nope"}), 404,
             "not_found_error"),
            (await client.post("/v1/messages", data=b"{nope",
                               headers={"Content-Type": "application/json"}), 400,
             "invalid_request_error"),
            (await client.get("/v1/messages"), 405, "invalid_request_error"),
            (await client.post("/v1/messages/nothing", json=BODY), 404, "not_found_error"),
            (await client.post("/v1/messages", data="x", headers={"Content-Type": "text/plain"}),
             415, "invalid_request_error"),
        ]
        for resp, status, kind in cases:
            body = await resp.json()
            assert resp.status == status, body
            validate(body, "ErrorResponse")
            assert body["error"]["type"] == kind and body["request_id"]
        r = await client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
    finally:
        await client.close()


async def test_a_failure_mid_stream_ends_with_an_error_event():
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=50, crash_after_tokens=2)})
    client = await client_for(world, restart_backoff=5.0)
    try:
        r = await client.post("/v1/messages", json={**BODY, "max_tokens": 50, "stream": True})
        events = events_of(await r.text())
        for name, data in events:
            validate_event(name, data)
        name, data = events[-1]
        assert name == "error" and data["error"]["type"] in ("api_error", "overloaded_error")
        assert "message_stop" not in [n for n, _ in events]
    finally:
        await client.close()


async def test_count_tokens_asks_the_worker_to_tokenize():
    world = FakeWorld(FakeBehaviour())
    client = await client_for(world)
    try:
        body = {k: v for k, v in BODY.items() if k != "max_tokens"}
        r = await client.post("/v1/messages/count_tokens", json=body)
        got = await r.json()
        assert r.status == 200, got
        validate(got, "MessageTokensCount")
        assert got["input_tokens"] == 2  # the fake counts the contents' bytes: "hi"
        sent = world.received[-1]
        assert sent.task.value == "tokenize" and sent.messages == [{"role": "user",
                                                                   "content": "hi"}]
    finally:
        await client.close()
