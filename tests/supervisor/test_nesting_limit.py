"""A value in a body may nest objects and arrays 64 levels deep (the body's own object
holds it); the 65th is a 400 naming where (supervisor/http/values.py, docs/api.md's "Bad
input"). Exactly at the limit, on both sides, in the walk and over HTTP
(tests/fuzz/test_fuzz_routes.py checks the same edge on every surface of a real server)."""

from __future__ import annotations

import json

from supervisor.http.values import MAX_DEPTH, first_bad_value
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for


def levels(n: int) -> dict:
    """A body whose value `deep` is `n` arrays inside each other."""
    inner: object = 1
    for _ in range(n):
        inner = [inner]
    return {"deep": inner}


def test_a_value_may_nest_64_levels_and_not_65():
    assert MAX_DEPTH == 64
    assert first_bad_value(levels(64)) is None
    path, why = first_bad_value(levels(65))
    assert path == "deep" + "[0]" * 64 and "nesting too deep" in why
    assert first_bad_value({"deep": json.loads('{"a":' * 64 + "1" + "}" * 64)}) is None
    assert first_bad_value({"deep": json.loads('{"a":' * 65 + "1" + "}" * 65)}) is not None


async def test_over_http_64_levels_pass_the_check_and_65_are_a_400():
    client = await client_for(FakeWorld(FakeBehaviour(tokens=1)))
    try:
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/chat/completions", json={**chat, **levels(64)})
        assert "nesting too deep" not in await r.text()
        r = await client.post("/v1/chat/completions", json={**chat, **levels(65)})
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "invalid_value"
        assert err["param"] == "deep" + "[0]" * 64 and "at most 64 levels" in err["message"]
    finally:
        await client.close()
