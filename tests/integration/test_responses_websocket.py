"""WebSocket mode of the Responses API (supervisor/api/responses/websocket.py) end to end:
the real supervisor and worker, aiohttp's WebSocket client and the official SDK's
`responses.connect()`, the cases of the Open Responses suite's WebSocket tests
(sequential responses, continuation, store:false in-connection cache, missing previous
response, a failed continuation evicting the cache), a warm-up (`generate: false`) and
ours (bad messages, closing mid-response). The guard on the upgrade (keys, Origin) and shutdown are in
tests/supervisor/test_responses_websocket_guard.py."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import httpx
import openai

from tests.integration.conftest import assert_envelope
from tests.integration.test_responses import check_events
from tests.openresponses import schema as openresponses
from tests.schema import validate

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def create(model_id, **kw) -> dict:
    return {"type": "response.create", "model": model_id, "input": "Tell me something",
            "max_output_tokens": 8, "temperature": 0, **kw}


async def turn(ws) -> list[dict]:
    """The events of one response (to its terminal event), or [the error event]."""
    events = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), 60)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        events.append(json.loads(msg.data))
        if events[-1]["type"] == "error":
            assert len(events) == 1, events  # an error comes instead of a response
            return events
        if events[-1]["type"] in TERMINAL:
            return events


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def error_of(events: list, status: int, code: str | None = None) -> dict:
    (event,) = events
    assert event["type"] == "error" and event["status"] == status, event
    validate(event, "ResponseWsError")  # OpenAI's WebSocket error event
    openresponses.validate(event, "StreamingEvent")  # and the Open Responses error event
    assert set(event["error"]) >= {"message", "type", "param", "code"}
    if code is not None:
        assert event["error"]["code"] == code, event
    return event["error"]


async def test_sequential_responses_are_the_http_stream_s_events(server, model_id, http):
    async with aiohttp.ClientSession() as s, s.ws_connect(ws_url(server)) as ws:
        # Sent together, run one after the other (FIFO), each one's events whole.
        await ws.send_str(json.dumps(create(model_id, input="first")))
        await ws.send_str(json.dumps(create(model_id, input="second", stream_id="lane-2")))
        first, second = await turn(ws), await turn(ws)
    one = check_events(first)  # valid events, sequence numbers 0, 1, 2, ...
    assert all("stream_id" not in e for e in first)
    for e in second:
        assert e.pop("stream_id") == "lane-2"
    two = check_events(second)
    assert one["id"] != two["id"] and one["status"] == two["status"] == "incomplete"
    assert one["output"] and two["output"]
    # Stored like a POST's: the same object, and the same kinds of events as its replay.
    assert http.get(f"/v1/responses/{one['id']}").json() == one
    with http.stream("GET", f"/v1/responses/{two['id']}?stream=true") as r:
        replay = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert {e["type"] for e in replay} == {e["type"] for e in second}  # (deltas merged)
    text = "".join(e["delta"] for e in second if e["type"] == "response.output_text.delta")
    assert text == two["output"][0]["content"][0]["text"]


async def test_store_false_continues_from_the_connection_cache_only(server, model_id, http):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(ws_url(server)) as ws:
            await ws.send_str(json.dumps(create(model_id, store=False,
                                                input="Remember the code word: cobalt.")))
            r1 = check_events(await turn(ws))
            await ws.send_str(json.dumps(create(model_id, store=False, input="The word?",
                                                previous_response_id=r1["id"])))
            r2 = check_events(await turn(ws))
            assert r2["status"] == "incomplete" and r2["previous_response_id"] == r1["id"]
            # The model read the first turn and its answer: more than this turn's input.
            assert r2["usage"]["input_tokens"] > r1["usage"]["input_tokens"] + \
                r1["usage"]["output_tokens"]
            # The connection keeps its latest response only: r1 is gone now.
            await ws.send_str(json.dumps(create(model_id, store=False, input="again",
                                                previous_response_id=r1["id"])))
            error_of(await turn(ws), 404, "previous_response_not_found")
        # Nothing was stored: neither HTTP nor another connection can continue it.
        assert_envelope(http.post("/v1/responses", json={
            "model": model_id, "input": "x", "previous_response_id": r2["id"]}),
            404, "previous_response_not_found")
        async with s.ws_connect(ws_url(server)) as ws:
            await ws.send_str(json.dumps(create(model_id, store=False, input="continue",
                                                previous_response_id=r2["id"])))
            err = error_of(await turn(ws), 404, "previous_response_not_found")
            assert err["param"] == "previous_response_id"
            await ws.send_str(json.dumps(create(model_id, store=False, input="fresh start")))
            assert check_events(await turn(ws))["status"] == "incomplete"  # recovered


async def test_stored_responses_continue_across_connections(server, model_id):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(ws_url(server)) as ws:
            await ws.send_str(json.dumps(create(model_id, input="seed")))
            r1 = check_events(await turn(ws))
        async with s.ws_connect(ws_url(server)) as ws:
            await ws.send_str(json.dumps(create(model_id, previous_response_id=r1["id"])))
            r2 = check_events(await turn(ws))
    assert r2["usage"]["input_tokens"] > r1["usage"]["input_tokens"]


ORPHAN = [{"type": "function_call_output", "call_id": "call_none", "output": "a result"}]


async def test_a_failed_turn_evicts_the_cache(server, model_id, http):
    async with aiohttp.ClientSession() as s, s.ws_connect(ws_url(server)) as ws:
        await ws.send_str(json.dumps(create(model_id, store=False, input="seed")))
        r1 = check_events(await turn(ws))
        # A tool output that answers no call of the chain fails (as over HTTP, below).
        await ws.send_str(json.dumps(create(model_id, store=False, input=ORPHAN,
                                            previous_response_id=r1["id"])))
        assert error_of(await turn(ws), 400)["param"] == "input"
        await ws.send_str(json.dumps(create(model_id, store=False,
                                            previous_response_id=r1["id"])))
        error_of(await turn(ws), 404, "previous_response_not_found")
    assert "call_none" in assert_envelope(
        http.post("/v1/responses", json={"model": model_id, "input": ORPHAN}), 400,
        param="input")["message"]


async def test_bad_messages_are_error_events_and_the_socket_stays(server, model_id, http):
    async with aiohttp.ClientSession() as s, s.ws_connect(ws_url(server)) as ws:
        for bad, param in [("{not json", None), ("[1, 2]", None),
                           (json.dumps({"model": model_id, "input": "x"}), "type"),
                           (json.dumps({"type": "session.update"}), "type"),
                           (json.dumps(create(model_id, background=True)), "background"),
                           (json.dumps(create(model_id, generate="no")), "generate"),
                           (json.dumps(create(model_id, stream_id="a b")), "stream_id"),
                           (json.dumps(create(model_id, input=None)), "input"),
                           (json.dumps(create("no-such-model")), "model")]:
            await ws.send_str(bad)
            (event,) = await turn(ws)
            assert event["type"] == "error" and event["error"]["param"] == param, (bad, event)
            assert event["status"] in (400, 404) and event["error"]["message"]
        await ws.send_bytes(b'{"type": "response.create"}')
        error_of(await turn(ws), 400)
        await ws.send_str(json.dumps(create(model_id)))
        assert check_events(await turn(ws))["status"] == "incomplete"
    # A plain GET (no upgrade) is told what the route is.
    r = http.get("/v1/responses")
    assert_envelope(r, 426, "upgrade_required")
    assert r.headers["Upgrade"] == "websocket"


def _in_flight(http) -> int:
    return sum(w["in_flight"] + w["worker_active"] for w in http.get("/health").json()["workers"])


async def test_closing_mid_response_cancels_it(server, model_id, http):
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(ws_url(server))
        await ws.send_str(json.dumps(create(model_id, max_output_tokens=3000)))
        rid, deltas = None, 0
        while deltas < 3:
            event = json.loads((await asyncio.wait_for(ws.receive(), 60)).data)
            rid = rid or event["response"]["id"]
            deltas += event["type"] == "response.output_text.delta"
        await ws.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
            _in_flight(http) or http.get(f"/v1/responses/{rid}").json()["status"]
            == "in_progress"):
        await asyncio.sleep(0.05)
    assert _in_flight(http) == 0
    stored = http.get(f"/v1/responses/{rid}").json()
    assert stored["status"] == "cancelled", stored["status"]
    assert stored["usage"]["output_tokens"] < 3000


async def test_the_openai_sdk_connects(server, model_id):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client.responses.connect() as conn:
        await conn.send(create(model_id, input="hello"))
        types = []
        async for event in conn:
            types.append(event.type)
            if event.type in TERMINAL:
                break
        assert event.response.status == "incomplete" and event.response.output
        await conn.send(create(model_id, previous_response_id="resp_missing"))
        async for event in conn:
            break
        assert event.type == "error" and event.error.code == "previous_response_not_found"
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types


async def test_a_warm_up_prepares_the_turn_that_continues_it(server, model_id, http):
    """`generate: false`: a response with no output, continued from like any other, whose
    prompt the worker already holds: the next turn reports it as cached."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    rules = f"You are the warm-up test's assistant, started at {time.time()}."  # unseen
    async with client.responses.connect() as conn:
        for store in (False, True):
            await conn.send(create(model_id, instructions=rules, generate=False, store=store,
                                   input=f"Here is the plan (store {store})."))
            events = []
            async for event in conn:
                events.append(event.model_dump(mode="json", exclude_unset=True))
                if event.type in TERMINAL:
                    break
            warm = check_events(events)
            assert [e["type"] for e in events] == [
                "response.created", "response.in_progress", "response.completed"]
            assert warm["output"] == [] and warm["status"] == "completed"
            assert warm["usage"]["output_tokens"] == 0 and warm["usage"]["input_tokens"] > 10
            await conn.send(create(model_id, instructions=rules, store=store,
                                   previous_response_id=warm["id"], input="Go."))
            async for event in conn:
                if event.type in TERMINAL:
                    break
            assert event.response.output  # generated this time
            cached = event.response.usage.input_tokens_details.cached_tokens
            # All the warm-up's prompt but the assistant turn it opened was prefilled.
            assert cached >= warm["usage"]["input_tokens"] - 4, (cached, warm["usage"])
    # Stored: GET has it, and a POST continues from it.
    assert http.get(f"/v1/responses/{warm['id']}").json() == warm
    r = http.post("/v1/responses", json={"model": model_id, "previous_response_id": warm["id"],
                                         "instructions": rules, "input": "Again.",
                                         "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > warm["usage"][
        "input_tokens"]
