"""Issue "Nothing a client sends may take a model down", finding 1, with real processes.

Each of these bodies once made msgpack fail inside the runner's send: the request got a
500 but kept the worker's only slot, every later request waited for a 503, and the crash
budget ended with the model `broken`. Now each is a 400 naming the parameter, and the
model answers a normal request right after, within seconds.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.conftest import assert_envelope
from tests.serverproc import ServerProcess

BIG = 2 ** 64  # one past what msgpack carries
SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def srv(tiny_model):
    with ServerProcess([str(tiny_model)]) as s:
        s.wait_healthy()
        yield s


def chat(model, **kw):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def tool(default):
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "default": default}}}}}


# (route, body builder, the param the 400 must name)
CASES = [
    ("/v1/chat/completions",
     lambda m: chat(m, messages=[{"role": "user", "content": "a" + SURROGATE}]),
     "messages[0].content"),
    ("/v1/chat/completions", lambda m: chat(m, stop=[SURROGATE]), "stop[0]"),
    ("/v1/completions", lambda m: {"model": m, "prompt": SURROGATE + "x", "max_tokens": 3},
     "prompt"),
    ("/v1/responses", lambda m: {"model": m, "input": "x" + SURROGATE}, "input"),
    ("/v1/chat/completions", lambda m: chat(m, max_tokens=BIG), "max_tokens"),
    ("/v1/responses", lambda m: {"model": m, "input": "x", "max_output_tokens": BIG},
     "max_output_tokens"),
    ("/v1/chat/completions", lambda m: chat(m, top_k=BIG), "top_k"),
    ("/v1/chat/completions", lambda m: chat(m, logit_bias={str(BIG): 1}), "logit_bias"),
    ("/v1/chat/completions", lambda m: chat(m, tools=[tool(BIG)]),
     "tools[0].function.parameters.properties.x.default"),
    ("/v1/chat/completions", lambda m: chat(m, chat_template_kwargs={"k": BIG}),
     "chat_template_kwargs.k"),
    # Inside 64 bits, but beyond what this model means by them: refused before queueing.
    ("/v1/chat/completions", lambda m: chat(m, top_k=2 ** 63 - 1), "top_k"),
    ("/v1/chat/completions", lambda m: chat(m, logit_bias={str(2 ** 40): 1}), "logit_bias"),
    ("/v1/chat/completions", lambda m: chat(m, max_tokens=2 ** 63 - 1), "max_tokens"),
]


@pytest.mark.parametrize("route,make,param", CASES,
                         ids=[f"{r.rsplit('/', 1)[-1]}:{p}" for r, _, p in CASES])
def test_a_value_that_cannot_travel_is_a_400_and_the_model_keeps_serving(
        srv, tiny_model, route, make, param):
    model = str(tiny_model)
    # json.dumps writes a lone surrogate as the escape "\ud800": valid JSON, as sent.
    raw = json.dumps(make(model))
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
        err = assert_envelope(r, 400)
        assert err["param"] == param or (param == "input" and err["param"].startswith("input")), err
        # The same model serves a normal request at once: nothing holds its slot.
        ok = http.post("/v1/chat/completions", json=chat(model), timeout=10)
        assert ok.status_code == 200, ok.text
    _, health = srv.get("/health")
    worker = health["workers"][0]
    assert worker["state"] == "ready" and worker["restarts"] == 0 and worker["in_flight"] == 0


def test_a_limit_beyond_the_model_names_the_surfaces_own_parameter(srv, tiny_model):
    model = str(tiny_model)
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        r = http.post("/v1/responses", json={"model": model, "input": "x",
                                             "max_output_tokens": 10 ** 6})
        err = assert_envelope(r, 400, param="max_output_tokens")
        assert "4096" in err["message"]  # the model's context, which it cannot exceed
        r = http.post("/v1/chat/completions", json=chat(model, max_tokens=4097))
        assert_envelope(r, 400, param="max_tokens")
        assert http.post("/v1/chat/completions", json=chat(model, max_tokens=3)).status_code == 200
