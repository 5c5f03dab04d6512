"""The Responses API end to end: real processes, OpenAI's spec, the official client."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.integration.conftest import assert_envelope, sse_events
from tests.openresponses.schema import check_event, check_response
from tests.schema import validate
from tests.serverproc import ServerProcess


def create(http, model_id, **kw):
    body = {"model": model_id, "input": "Tell me something", "max_output_tokens": 8,
            "temperature": 0, **kw}
    return http.post("/v1/responses", json=body)


def stream(http, model_id, **kw) -> list:
    body = {"model": model_id, "input": "Tell me something", "max_output_tokens": 8,
            "temperature": 0, "stream": True, **kw}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def check_events(events: list) -> dict:
    """Every event valid against the spec, sequence numbers 0, 1, 2, ...; returns the
    final response."""
    for ev in events:
        check_event(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    return events[-1]["response"]


def test_create_shape_usage_and_incomplete(http, model_id):
    r = create(http, model_id)
    assert r.status_code == 200
    resp = r.json()
    check_response(resp)
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["output_tokens"] == 8 and resp["usage"]["input_tokens"] > 3
    (msg,) = resp["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"][0]["type"] == "output_text"
    # stored: GET returns the same object
    got = http.get(f"/v1/responses/{resp['id']}").json()
    assert got == resp


def test_stream_events_lifecycle_and_same_text(http, model_id):
    events = stream(http, model_id)
    final = check_events(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"]
    assert text == create(http, model_id).json()["output"][0]["content"][0]["text"]


def test_get_with_stream_replays_the_events(http, model_id):
    live = stream(http, model_id)
    rid = live[0]["response"]["id"]
    with http.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as r:
        replayed = sse_events(r)
    final = check_events(replayed)

    def kinds(evs):  # the replay tells each item's text in one delta
        out = [e["type"] for e in evs]
        return [k for i, k in enumerate(out) if not (k.endswith(".delta") and out[i - 1] == k)]
    assert kinds(replayed) == kinds(live)
    deltas = lambda evs: "".join(e.get("delta", "") for e in evs)  # noqa: E731
    assert deltas(replayed) == deltas(live)
    assert final == live[-1]["response"]
    with http.stream("GET", f"/v1/responses/{rid}",
                     params={"stream": "true", "starting_after": 3}) as r:
        tail = sse_events(r)
    assert tail[0]["sequence_number"] == 4 and tail == replayed[4:]


def test_previous_response_chain_and_instructions_not_inherited(http, model_id):
    instructions = "You are a careful assistant who answers in full sentences. " * 4
    t1 = create(http, model_id, instructions=instructions, input="first").json()
    t2 = create(http, model_id, previous_response_id=t1["id"], input="second").json()
    t2i = create(http, model_id, previous_response_id=t1["id"], input="second",
                 instructions=instructions).json()
    t3 = create(http, model_id, previous_response_id=t2["id"], input="third").json()
    for t in (t1, t2, t2i, t3):
        check_response(t)
    assert t2["previous_response_id"] == t1["id"] and t2["instructions"] is None
    u1, u2, u2i, u3 = (t["usage"]["input_tokens"] for t in (t1, t2, t2i, t3))
    # The history is replayed: turn 2 sees turn 1's input and output...
    assert u2 > t1["usage"]["output_tokens"] + 2
    # ...but not turn 1's instructions (only when given again).
    assert u2i - u2 > 20
    assert u3 > u2 + t2["usage"]["output_tokens"]


def test_store_false_then_chain_is_404_and_delete(http, model_id):
    t = create(http, model_id, store=False).json()
    assert t["store"] is False
    assert_envelope(http.get(f"/v1/responses/{t['id']}"), 404)
    r = create(http, model_id, previous_response_id=t["id"])
    err = assert_envelope(r, 404, param="previous_response_id")
    assert t["id"] in err["message"]
    kept = create(http, model_id).json()
    d = http.delete(f"/v1/responses/{kept['id']}")
    assert d.status_code == 200 and d.json() == {"id": kept["id"], "object": "response",
                                                  "deleted": True}
    assert_envelope(http.get(f"/v1/responses/{kept['id']}"), 404)
    assert_envelope(create(http, model_id, previous_response_id=kept["id"]), 404)


def test_input_items_listing(http, model_id):
    body_input = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                     {"type": "text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    t = create(http, model_id, input=body_input).json()
    listing = http.get(f"/v1/responses/{t['id']}/input_items").json()
    validate(listing, "ResponseItemList")
    assert len(listing["data"]) == 4 and listing["has_more"] is False
    assert listing["data"][0]["content"][0]["text"] == "again"  # newest first by default
    asc = http.get(f"/v1/responses/{t['id']}/input_items",
                   params={"order": "asc", "limit": 2}).json()
    assert [i["role"] for i in asc["data"]] == ["developer", "user"] and asc["has_more"]
    after = http.get(f"/v1/responses/{t['id']}/input_items",
                     params={"order": "asc", "after": asc["last_id"]}).json()
    assert [i["role"] for i in after["data"]] == ["assistant", "user"]


@pytest.mark.parametrize("body,param", [
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),  # not a data: URL
    ({"temperature": "hot"}, "temperature"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"background": True, "store": False}, "background"),
])
def test_bad_requests_are_400(http, model_id, body, param):
    assert_envelope(create(http, model_id, **body), 400, param=param)


def test_a_prompt_the_worker_refuses_names_this_apis_input(http, model_id):
    # The worker names the chat messages it was given; this API's field is `input`.
    r = create(http, model_id, input="word " * 6000)
    assert_envelope(r, 400, code="context_length_exceeded", param="input")


def test_reasoning_items_and_builtin_tools_are_not_errors(http, model_id):
    r = create(http, model_id, tools=[{"type": "web_search"}], input=[
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hmm"}]},
        {"role": "user", "content": "x"}])
    assert r.status_code == 200
    assert "web_search" in r.headers["X-MLXD-Warning"]


def test_background_poll_and_cancel(http, model_id):
    r = create(http, model_id, background=True, max_output_tokens=16)
    assert r.status_code == 200
    first = r.json()
    check_response(first)
    assert first["status"] in ("queued", "in_progress") and first["background"] is True
    deadline = time.monotonic() + 30
    while True:
        polled = http.get(f"/v1/responses/{first['id']}").json()
        if polled["status"] not in ("queued", "in_progress"):
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled["status"] == "incomplete" and polled["usage"]["output_tokens"] == 16
    long = create(http, model_id, background=True, max_output_tokens=3000).json()
    cancelled = http.post(f"/v1/responses/{long['id']}/cancel")
    assert cancelled.status_code == 200
    body = cancelled.json()
    check_response(body)
    assert body["status"] == "cancelled"
    assert http.get(f"/v1/responses/{long['id']}").json()["status"] == "cancelled"
    # cancelling a foreground response is refused
    fg = create(http, model_id).json()
    assert_envelope(http.post(f"/v1/responses/{fg['id']}/cancel"), 400)


def test_openai_client_create_stream_and_chain(client, model_id):
    r1 = client.responses.create(model=model_id, input="Hi", max_output_tokens=6, temperature=0)
    assert r1.status == "incomplete" and r1.usage.output_tokens == 6
    assert isinstance(r1.output_text, str) and r1.output_text
    events = list(client.responses.create(model=model_id, input="Go", max_output_tokens=5,
                                          previous_response_id=r1.id, temperature=0,
                                          stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # A random model never stops on its own: the stream ends "incomplete" at the limit.
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert "".join(deltas) == final.output_text and final.previous_response_id == r1.id
    r3 = client.responses.create(model=model_id, input="More", previous_response_id=final.id,
                                 max_output_tokens=4)
    assert r3.usage.input_tokens > final.usage.input_tokens
    assert client.responses.retrieve(r3.id).id == r3.id
    client.responses.delete(r3.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)


def test_chain_survives_a_restart_and_in_progress_is_failed(tiny_model, tmp_path):
    model = str(tiny_model)
    with ServerProcess([model], state_dir=tmp_path) as srv:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            t1 = create(http, model).json()
            running = create(http, model, background=True, max_output_tokens=4000).json()
        srv.proc.send_signal(signal.SIGKILL)  # no chance to finish anything
        srv.proc.wait()
    with ServerProcess([model], state_dir=tmp_path) as srv:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            t2 = create(http, model, previous_response_id=t1["id"], input="again")
            assert t2.status_code == 200
            assert t2.json()["usage"]["input_tokens"] > t1["usage"]["input_tokens"]
            lost = http.get(f"/v1/responses/{running['id']}").json()
            assert lost["status"] == "failed" and "restarted" in lost["error"]["message"]
            check_response(lost)


def test_worker_crash_mid_stream_is_response_failed(tiny_model):
    model = str(tiny_model)
    with ServerProcess([model]) as srv:
        srv.wait_healthy()
        pid = srv.worker_pids()[0]
        body = {"model": model, "input": "x", "max_output_tokens": 3000, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            with http.stream("POST", "/v1/responses", json=body) as s:
                events = []
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if len(events) == 5:
                            os.kill(pid, signal.SIGKILL)
        import json
        parsed = [json.loads(e[6:]) for e in events]
        final = check_events(parsed)
        assert parsed[-1]["type"] == "response.failed" and final["status"] == "failed"
        assert "retry" in final["error"]["message"]
        # The message it ended inside is not `completed`; usage counts what was read.
        assert [o["status"] for o in final["output"]] == ["incomplete"]
        assert final["usage"]["input_tokens"] > 0
