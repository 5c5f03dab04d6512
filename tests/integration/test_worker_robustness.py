"""Issue #9 ("Nothing a client sends may take a model down"), findings 2, 3, 6a and 7,
with real supervisor and worker processes over HTTP.

Each hostile request gets a clear answer (a 200 where the value means something, else a
4xx in the OpenAI envelope, never a 500) in bounded time, and the same model serves a
normal request right after, within seconds. The worker-level tests (tests/worker/) pin
the mechanisms: recovery after a failed step, preparation off the MLX thread (which the
supervisor's one-request-per-slot dispatch cannot show from here), the grammar cache.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.integration.conftest import assert_envelope, sse_events
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Tell me something"}]
RECURSIVE_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
HUGE_PATTERN = {"type": "string", "pattern": "^(a{1000}){1000}$"}


@pytest.fixture(scope="module")
def srv(tiny_model):
    with ServerProcess([str(tiny_model)]) as s:
        s.wait_healthy()
        yield s


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model)


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": PROMPT, "max_tokens": 8, **kw}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def assert_serves(http: httpx.Client, model: str) -> None:
    """The model answers a normal request at once: nothing was left poisoned or blocked."""
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions", json=chat(model, temperature=1.0), timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert time.monotonic() - t0 < 5.0


def test_top_k_up_to_the_vocabulary_means_no_filtering(http, model, tiny_model):
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    # top_k == vocabulary reaches the worker (finding 2: a 500, then 500s for everyone).
    r = http.post("/v1/chat/completions", json=chat(model, temperature=1.0, top_k=vocab))
    assert r.status_code == 200, r.text
    assert_serves(http, model)
    # Above it: the supervisor knows the vocabulary (from `ready`) and refuses it, naming
    # top_k; the worker would take it as "no filtering" (tests/worker: the clamp).
    r = http.post("/v1/chat/completions",
                  json=chat(model, temperature=1.0, top_k=vocab + 1000))
    assert_envelope(r, 400, param="top_k")
    assert_serves(http, model)
    assert_serves(http, model)


def test_a_negative_seed_is_accepted_and_reproducible(http, model):
    body = chat(model, temperature=1.0, seed=-1, max_tokens=16)
    texts = []
    for _ in range(2):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]
    assert_serves(http, model)


def test_a_wide_any_of_schema_is_a_400_in_bounded_time_and_others_are_served(http, srv,
                                                                            model):
    """Finding 3: an `anyOf` of 5000 small object branches (~0.6 MB) got no answer in
    70 s while every other client of the model waited."""
    schema = {"anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "string"},
                                                          f"q{i}": {"type": "integer"}},
                         "required": [f"p{i}", f"q{i}"]} for i in range(5000)]}
    stream: dict = {}

    def other_client():
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions",
                          json=chat(model, max_tokens=300, stream=True)) as r:
                stream["status"] = r.status_code
                stream["events"] = sse_events(r)

    t = threading.Thread(target=other_client)
    t.start()
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions",
                  json=chat(model, response_format=schema_format(schema)))
    took = time.monotonic() - t0
    t.join(60)
    err = assert_envelope(r, 400, param="response_format")
    assert len(err["message"]) < 1000  # the error names the problem, not the grammar
    assert took < 30, took
    assert stream["status"] == 200 and stream["events"][-1] == "[DONE]"
    assert stream["events"][-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert_serves(http, model)


def test_an_empty_language_schema_is_a_400_not_empty_success(http, model):
    r = http.post("/v1/chat/completions",
                  json=chat(model, response_format=schema_format({"$ref": "#"})))
    assert_envelope(r, 400, param="response_format")
    assert_serves(http, model)


@pytest.mark.parametrize("schema", [RECURSIVE_REQUIRED, HUGE_PATTERN],
                         ids=["recursive-required", "pattern"])
def test_a_schema_that_fails_mid_decode_is_a_request_error(http, model, schema):
    body = chat(model, response_format=schema_format(schema))
    assert_envelope(http.post("/v1/chat/completions", json=body), 400, param="response_format")
    # Streaming: the status line may have gone out; the error is the stream's last event.
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code == 200:
            last = sse_events(r)[-1]
            assert last["error"]["param"] == "response_format"
            assert last["error"]["type"] == "invalid_request_error"
        else:
            r.read()
            assert_envelope(r, 400, param="response_format")
    assert_serves(http, model)


def test_a_hopeless_prompt_is_refused_fast(http, model):
    """Finding 7: a 14 MB message got its context_length_exceeded after 19 s of
    tokenizing, the model serving nobody meanwhile."""
    body = chat(model, messages=[{"role": "user", "content": "hello world " * ((14 << 20) // 12)}])
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions", json=body)
    took = time.monotonic() - t0
    assert_envelope(r, 400, code="context_length_exceeded", param="messages")
    assert took < 5.0, took
    assert_serves(http, model)
