"""Values JSON allows but nothing downstream can carry: lone surrogates, integers beyond
64 bits, numbers beyond a double. Refused at the surface with a 400 naming the path."""

from __future__ import annotations

import json

import pytest

from protocol import Generate, SamplingParams, encode
from supervisor.http.values import INT_MAX, INT_MIN, first_bad_value
from tests.supervisor.test_app import client_for
from tests.supervisor.fakes import FakeBehaviour, FakeWorld


@pytest.mark.parametrize("body,path", [
    ({"messages": [{"role": "user", "content": "ok \ud800"}]}, "messages[0].content"),
    ({"stop": ["a", "\udfff"]}, "stop[1]"),
    ({"max_tokens": 2 ** 64}, "max_tokens"),
    ({"seed": INT_MIN - 1}, "seed"),
    ({"logit_bias": {"12": 2 ** 63}}, "logit_bias.12"),
    ({"tools": [{"function": {"parameters": {"default": 10 ** 40}}}]},
     "tools[0].function.parameters.default"),
    ({"chat_template_kwargs": {"k": [1, {"x": 2 ** 70}]}}, "chat_template_kwargs.k[1].x"),
    ({"metadata": {"\ud83d": "v"}}, "metadata"),                      # a bad key
    ({"temperature": float("inf")}, "temperature"),                    # 1e999 in JSON
])
def test_the_first_bad_value_is_named_by_its_path(body, path):
    found = first_bad_value(body)
    assert found is not None and found[0] == path


def test_good_bodies_pass_untouched():
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo 😀 中文"}],
            "max_tokens": INT_MAX, "seed": INT_MIN, "temperature": 1e308, "n": None,
            "stream": True, "tools": [{"function": {"parameters": {"minimum": -1.5}}}]}
    assert first_bad_value(body) is None
    encode(Generate(rid="x", messages=body["messages"],
                    sampling=SamplingParams(seed=INT_MIN, max_tokens=INT_MAX)))


def test_document_order_reports_the_first_offender():
    body = {"a": [1, "\ud800"], "b": 2 ** 64}
    assert first_bad_value(body)[0] == "a[1]"


def test_a_long_list_of_ints_is_checked_whole_and_its_offender_named():
    # Token ids take a fast path (http/values.py _plain_ints); an offender anywhere in
    # the list still gets its path, and lists of other things are walked as before.
    ids = list(range(20000))
    assert first_bad_value({"prompt": ids}) is None
    assert first_bad_value({"prompt": [INT_MIN, INT_MAX, True, False]}) is None
    for bad in (2 ** 64, INT_MIN - 1):
        found = first_bad_value({"prompt": ids[:12345] + [bad] + ids[12345:]})
        assert found is not None and found[0] == "prompt[12345]"


def test_deep_nesting_is_refused_at_the_limit_without_recursion():
    from supervisor.http.values import MAX_DEPTH

    def nest(depth, inner):
        body = inner
        for _ in range(depth):
            body = {"k": [body]}
        return body

    assert first_bad_value(nest(MAX_DEPTH // 2, {"ok": 1})) is None
    path, why = first_bad_value(nest(5000, 1))  # deeper than Python could recurse
    assert "nesting too deep" in why and path.count(".k") == MAX_DEPTH // 2


# ---- over HTTP: the app refuses before any worker sees the request --------------------

ROUTES = {
    "/v1/chat/completions": {"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "fake", "prompt": "hi"},
    "/v1/responses": {"model": "fake", "input": "hi"},
}


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_every_route_refuses_them_with_an_envelope_naming_the_param(route):
    world = FakeWorld(FakeBehaviour(tokens=2))
    client = await client_for(world)
    try:
        base = ROUTES[route]
        raw = json.dumps({**base, "max_tokens": 2 ** 64, "stop": "\\ud800"})
        raw = raw.replace("\\\\ud800", "\\ud800")  # a lone surrogate escape, valid JSON
        for body, param in ((raw, "max_tokens"),
                            (json.dumps({**base, "user": "x"})[:-1] + ', "seed": 1e999}',
                             "seed")):
            r = await client.post(route, data=body,
                                  headers={"Content-Type": "application/json"})
            assert r.status == 400, await r.text()
            err = (await r.json())["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error"
        # Nothing reached the worker, and the model still serves.
        assert world.received == []
        r = await client.post(route, json=base)
        assert r.status == 200, await r.text()
    finally:
        await client.close()
