"""Property-based fuzzing of every route of a real mlxd (supervisor + worker processes).

Requests are built from valid ones by putting a hostile value (tests/fuzz/hostile.py) at
any place: lone surrogates, huge and negative integers, huge floats, NaN/Infinity
literals, deep nesting, wrong types, huge strings and lists. The properties, for every
request: no 5xx and no hang; every error is an OpenAI envelope with no traceback; a stream
never ends on a server-side error; and the model keeps serving a normal request (checked
every few requests and after each route's run) on the worker it started with.

Bounded for CI (about two minutes on 2 cores); MLXD_FUZZ_EXAMPLES scales the counts and
MLXD_FUZZ_SEED replays a run (the seed is in the report header and every failure).
"""

from __future__ import annotations

import json
import os
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from supervisor.admin.token import read_token
from tests.fuzz.conftest import SEED, TALLY
from tests.fuzz.hostile import hostile_values, mutate, nested, places, serialize
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

SCALE = float(os.environ.get("MLXD_FUZZ_EXAMPLES", "1"))
KNOWN_KEYS = [
    "model", "messages", "prompt", "input", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
    "stream", "stream_options", "logit_bias", "logprobs", "top_logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "tools", "tool_choice", "response_format",
    "text", "reasoning", "reasoning_effort", "chat_template_kwargs", "parallel_tool_calls",
    "user", "metadata", "store", "background", "previous_response_id", "instructions",
    "prompt_cache_key", "echo", "suffix", "best_of", "functions", "function_call", "content",
    "role", "type", "name", "arguments", "parameters", "schema", "strict", "include_usage",
    "effort", "format", "tool_call_id", "mode", "replace", "include", "truncation",
    "query", "documents", "top_n", "return_documents", "encoding_format", "dimensions",
    "tokens", "return_token_strs", "text", "system", "max_tokens", "stop_sequences",
    "thinking", "budget_tokens", "tool_use_id", "is_error", "input_schema", "id",
    "disable_parallel_tool_use", "signature", "cache_control",
]
CHECK_EVERY = 15  # requests between two normal requests


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None,
                    suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def srv(tiny_model, embed_model, reranker_model):
    # The text model first: the checks below follow its worker. The embedding model and
    # the reranker serve the routes that need them (/v1/embeddings, /v1/rerank).
    with ServerProcess([str(tiny_model), str(embed_model("bert")), str(reranker_model)]) as s:
        s.wait_healthy()
        s.first_pid = s.worker_pids()[0]
        yield s
        assert_model_serves(s, str(tiny_model))
        _, health = s.get("/health")
        w = health["workers"][0]
        assert w["pid"] == s.first_pid and w["restarts"] == 0, \
            f"the worker restarted during fuzzing (seed {SEED}): {w}"


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60, connect=5)) as c:
        c.sent = 0
        yield c


def assert_model_serves(srv, model: str) -> None:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=15, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, f"the model stopped serving (seed {SEED}): {r.text[:500]}"


def check(srv, http, model: str, label: str, method: str, url: str, *, content=None,
          headers=None, what=None) -> httpx.Response:
    """Send one request and assert the properties; every CHECK_EVERY, a normal request."""
    where = f"seed {SEED}; {method} {url}; {what!r}"[:2000]
    try:
        r = http.request(method, url, content=content, headers=headers)
    except httpx.TimeoutException:
        raise AssertionError(f"no answer within 60 s ({where})") from None
    TALLY[(label, r.status_code)] += 1
    assert r.status_code < 500, f"{r.status_code} {r.text[:500]} ({where})"
    assert "Traceback" not in r.text, where
    anthropic = url.split("?")[0].startswith("/v1/messages")
    if r.status_code >= 400 and anthropic:  # Anthropic's envelope on its routes
        body = r.json()
        assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", where
        assert set(body["error"]) - {"details"} == {"type", "message"}, where
        if "details" in body["error"]:  # a message thread's: the code the SDK replays on
            assert body["error"]["details"]["error_code"].startswith("thread_"), where
        assert body["error"]["message"] and body["error"]["type"] in (
            "invalid_request_error", "not_found_error"), where
    elif r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"}, where
        assert set(body["error"]) == {"message", "type", "param", "code"}, where
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error", where
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                err = event.get("error") or (event.get("response") or {}).get("error")
                assert not err or err.get("type") not in ("server_error", "api_error"), \
                    f"{err} ({where})"
    http.sent += 1
    if http.sent % CHECK_EVERY == 0:
        assert_model_serves(srv, model)
    return r


# ---- POST bodies ------------------------------------------------------------------------

def tool(name="f"):
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}, "s": {"type": "string"}},
        "required": ["x"]}}}


def bases(model: str, embed: str = "", rerank: str = "") -> dict[str, list[dict]]:
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "user", "content": "again"},
    ]
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
              "required": ["a"]}
    return {
        "/v1/chat/completions": [
            {"model": model, "messages": history, "max_tokens": 4, "temperature": 0.5,
             "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 1, "stop": ["\n\n"],
             "logit_bias": {"5": 1}, "presence_penalty": 0.1, "frequency_penalty": 0.1,
             "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 2, "tools": [tool()],
             "tool_choice": "auto", "user": "u", "metadata": {"k": "v"}, "n": 1,
             "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"},
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
             "stream": True, "stream_options": {"include_usage": True},
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": schema}}},
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
             "tools": [tool(), tool("g")], "parallel_tool_calls": False,
             "tool_choice": {"type": "function", "function": {"name": "g"}}},
        ],
        "/v1/completions": [
            {"model": model, "prompt": "Once upon", "max_tokens": 4, "temperature": 0,
             "seed": 3, "stop": "END", "logit_bias": {"7": -1}, "logprobs": 2},
            {"model": model, "prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
             "stream_options": {"include_usage": True}},
        ],
        "/v1/responses": [
            {"model": model, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "hi"}]}], "instructions": "be brief",
             "max_output_tokens": 4, "temperature": 0.5, "top_p": 0.9, "store": False,
             "metadata": {"k": "v"}, "reasoning": {"effort": "low"}},
            {"model": model, "input": "hi", "max_output_tokens": 4, "stream": True,
             "tools": [{"type": "function", "name": "f", "parameters": tool()["function"][
                 "parameters"]}], "tool_choice": "auto",
             "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}},
        ],
        "/v1/embeddings": [
            {"model": embed, "input": ["hi", "there"], "encoding_format": "base64",
             "dimensions": 32, "user": "u"},
            {"model": embed, "input": [[1, 2, 3], [4]], "encoding_format": "float"},
        ],
        "/v1/rerank": [
            {"model": rerank, "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1,
             "return_documents": True},
        ],
        "/tokenize": [
            {"model": model, "messages": history, "tools": [tool()],
             "return_token_strs": True},
            {"model": embed, "prompt": "hello"},
        ],
        "/detokenize": [{"model": model, "tokens": [1, 2, 3]}],
        "/v1/messages": [
            {"model": model, "max_tokens": 4, "system": [{"type": "text", "text": "be brief"}],
             "messages": [
                 {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "hm", "signature": "s"},
                     {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                               "content": "1", "is_error": False},
                                              {"type": "text", "text": "again"}]}],
             "tools": [{"name": "f", "input_schema": tool()["function"]["parameters"]}],
             "tool_choice": {"type": "auto"}, "stop_sequences": ["\n\n"], "top_k": 5,
             "temperature": 0.5, "top_p": 0.9, "metadata": {"user_id": "u"},
             "thinking": {"type": "disabled"}},
            {"model": model, "max_tokens": 4, "stream": True,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             "tools": [{"name": "f", "input_schema": tool()["function"]["parameters"]}],
             "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
             "thinking": {"type": "enabled", "budget_tokens": 1024}},
            {"model": model, "max_tokens": 4, "thread": {"type": "create"},
             "messages": [{"role": "user", "content": "hi"}],
             "output_config": {"format": {"type": "json_schema", "schema": schema}}},
            {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
             "thread": {"type": "continue", "previous_message_id": "msg_1"}},
            {"model": model, "max_tokens": 4, "compaction": {"type": "summarize"},
             "messages": [{"role": "assistant", "content": [
                 {"type": "compaction", "content": "s", "signature": "x"}]},
                 {"role": "user", "content": "hi"}]},
        ],
        "/v1/messages/count_tokens": [
            {"model": model, "system": "s", "messages": [{"role": "user", "content": "hi"}]},
        ],
        "/v1/responses/input_tokens": [
            {"model": model, "input": [{"role": "user", "content": "hi"}], "instructions": "s",
             "tools": [{"type": "function", "name": "f", "parameters": tool()["function"][
                 "parameters"]}], "tool_choice": "auto", "reasoning": {"effort": "low"}},
        ],
    }


@st.composite
def mutated_bodies(draw, route: str, models: tuple[str, str, str]):
    base = draw(st.sampled_from(bases(*models)[route]))
    place = draw(st.sampled_from(places(base)))
    key = draw(st.sampled_from(KNOWN_KEYS))
    value = draw(hostile_values())
    return serialize(mutate(base, place, key, value))


@pytest.mark.parametrize("route,examples", [
    ("/v1/chat/completions", 400), ("/v1/completions", 200), ("/v1/responses", 300),
    ("/v1/embeddings", 120), ("/v1/rerank", 80), ("/tokenize", 100), ("/detokenize", 50),
    ("/v1/messages", 250), ("/v1/messages/count_tokens", 60),
    ("/v1/responses/input_tokens", 60)])
def test_post_routes_survive_hostile_bodies(srv, http, tiny_model, embed_model,
                                            reranker_model, route, examples):
    model = str(tiny_model)
    models = (model, str(embed_model("bert")), str(reranker_model))

    @seed(SEED)
    @fuzz_settings(examples)
    @given(raw=mutated_bodies(route, models))
    def run(raw):
        check(srv, http, model, "POST " + route, "POST", route, content=raw.encode(
            "utf-8", "surrogatepass"), headers={"Content-Type": "application/json"}, what=raw[:300])

    run()
    assert_model_serves(srv, model)


# ---- ids and query strings --------------------------------------------------------------

def path_text() -> st.SearchStrategy:
    """Path segments and query values: any code point (surrogates too), bytes that are
    not UTF-8, traversal, NUL, and long ones, percent-encoded as a client would. (Three
    long values stay under aiohttp's 8 KiB request line: longer is not HTTP it parses,
    see test_a_request_line_too_long_for_http_is_refused_and_served_after.)"""
    raw = st.one_of(
        st.text(st.characters(codec=None, categories=None), min_size=1, max_size=30).map(
            lambda s: s.encode("utf-8", "surrogatepass")),
        st.binary(min_size=1, max_size=20),
        st.sampled_from([b"..", b"../../etc/passwd", b"\x00", b"%", b"resp_" + b"a" * 2000,
                         b"\xed\xa0\x80", b"-1", b"99999999999999999999999"]),
    )
    return raw.map(lambda b: urllib.parse.quote_from_bytes(b, safe=""))


@seed(SEED)
@fuzz_settings(300)
@given(ident=path_text(), value=path_text(), which=st.integers(0, 6))
def test_ids_and_queries_survive_hostile_text(srv, http, tiny_model, ident, value, which):
    model = str(tiny_model)
    method, url = [
        ("GET", f"/v1/responses/{ident}"),
        ("DELETE", f"/v1/responses/{ident}"),
        ("POST", f"/v1/responses/{ident}/cancel"),
        ("GET", f"/v1/responses/{ident}/input_items?limit={value}&order={value}&after={value}"),
        ("GET", f"/v1/responses/{ident}?stream=true&starting_after={value}"),
        ("GET", f"/v1/models/{ident}"),
        ("GET", f"/v1/models?after={value}&limit={value}"),
    ][which]
    label = f"{method} {url.split('/')[1]}/{url.split('/')[2].split('?')[0]}/" \
            + ("{id}" if which < 6 else "")
    check(srv, http, model, label, method, url, what=(ident, value))


# ---- the admin API, with its token --------------------------------------------------------

@st.composite
def admin_requests(draw):
    route, base = draw(st.sampled_from([
        ("/admin/load", {"model": "no-such-model"}),
        ("/admin/unload", {"model": "no-such-model", "mode": "drain"}),
        ("/admin/swap", {"model": "no-such-model", "mode": "drain", "replace": ["x"]}),
    ]))
    place = draw(st.sampled_from(places(base)))
    body = mutate(base, place, draw(st.sampled_from(KNOWN_KEYS)), draw(hostile_values()))
    if isinstance(body, dict) and body.get("model") in ("", None):
        body["model"] = "no-such-model"  # never name what is loaded
    return route, serialize(body)


@seed(SEED)
@fuzz_settings(120)
@given(req=admin_requests())
def test_admin_routes_survive_hostile_bodies(srv, http, tiny_model, req):
    route, raw = req
    token = read_token(srv.state_dir)
    check(srv, http, str(tiny_model), "POST " + route, "POST", route,
          content=raw.encode("utf-8", "surrogatepass"),
          headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
          what=raw[:300])


def test_a_request_line_too_long_for_http_is_refused_and_served_after(srv, tiny_model):
    """Past 8 KiB the request line is not parsed as HTTP at all: aiohttp's protocol layer
    answers a plain 400 and closes the connection before any route (or the envelope
    middleware) sees it. A 4xx, never a 5xx, and the model serves right after."""
    r = httpx.get(srv.url + "/v1/responses/resp_" + "a" * 9000, timeout=10)
    TALLY[("GET v1/responses/{id} (line > 8 KiB)", r.status_code)] += 1
    assert 400 <= r.status_code < 500 and "Traceback" not in r.text
    assert_model_serves(srv, str(tiny_model))


# ---- limits at their edge, and many small parts (issue 30) --------------------------------

NEST_BODIES = {
    "/v1/chat/completions": lambda m, deep: (
        f'{{"model": {json.dumps(m)}, "max_tokens": 2, "x_nested": {deep}, '
        '"messages": [{"role": "user", "content": "hi"}]}'),
    "/v1/responses": lambda m, deep: (
        f'{{"model": {json.dumps(m)}, "max_output_tokens": 2, "store": false, '
        f'"x_nested": {deep}, "input": "hi"}}'),
    "/v1/messages": lambda m, deep: (
        f'{{"model": {json.dumps(m)}, "max_tokens": 2, "x_nested": {deep}, '
        '"messages": [{"role": "user", "content": "hi"}]}'),
}


@pytest.mark.parametrize("route", sorted(NEST_BODIES))
@pytest.mark.parametrize("brackets", [("[", "]", "1"), ('{"a":', "}", "1")])
def test_nesting_is_served_at_64_levels_and_refused_at_65(srv, http, tiny_model, route,
                                                           brackets):
    """supervisor/http/values.py's MAX_DEPTH at its edge, through each surface: a top-level
    value nesting 64 objects or arrays is served; 65 are refused with a 400 in the
    surface's envelope that says why (OpenAI's names the parameter). The random deep
    values above (200 levels and more) cannot tell a limit of 64 from one of 100."""
    model = str(tiny_model)
    for depth, expected in ((64, 200), (65, 400)):
        raw = NEST_BODIES[route](model, nested(depth, *brackets).text)
        r = check(srv, http, model, f"POST {route} (nesting {depth})", "POST", route,
                  content=raw.encode(), headers={"Content-Type": "application/json"},
                  what=f"nesting {depth} {brackets[0]}")
        assert r.status_code == expected, f"nesting {depth}: {r.status_code} {r.text[:300]}"
        if expected == 400:
            err = r.json()["error"]
            assert "nest" in err["message"], err
            assert route == "/v1/messages" or err["param"].startswith("x_nested"), err


def tool_results(model: str, n: int) -> dict:
    """One Anthropic user turn of `n` tool_result blocks, after the tool_use they answer."""
    return {"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "1"}] * n}]}


def test_a_message_of_many_tool_results_is_refused_before_rendering(srv, http, tiny_model):
    """100,000 tool_result blocks in one user message (6 MB, under --max-body-bytes) can
    never fit a context: it must be refused at once for its size or count (400 or 413 in
    Anthropic's envelope), not parsed, converted and rendered for seconds first, which a
    refusal for context length (found only after rendering) shows."""
    model = str(tiny_model)
    raw = json.dumps(tool_results(model, 100_000))
    r = check(srv, http, model, "POST /v1/messages (100k tool_result)", "POST", "/v1/messages",
              content=raw.encode(), headers={"Content-Type": "application/json"},
              what="100k tool_result")
    assert r.status_code in (400, 413), r.text[:300]
    assert "content parts" in r.json()["error"]["message"], r.text[:300]  # the count's
    assert_model_serves(srv, model)
