"""A body may nest objects and arrays 64 levels deep, the body itself being the first;
the 65th is a 400 naming where (supervisor/http/values.py, README's "Bad input"). Exactly
at the limit, on both sides, in the walk and over HTTP."""

from __future__ import annotations

import json

from supervisor.http.values import MAX_DEPTH, first_bad_value
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for


def levels(n: int) -> dict:
    """A body of `n` levels: the object, then n - 1 arrays inside each other."""
    inner: object = 1
    for _ in range(n - 1):
        inner = [inner]
    return {"deep": inner}


def test_the_limit_counts_the_body_as_its_first_level():
    assert MAX_DEPTH == 64
    assert first_bad_value(levels(64)) is None
    path, why = first_bad_value(levels(65))
    assert path == "deep" + "[0]" * 63 and "nesting too deep" in why
    assert first_bad_value([[1]] * 3) is None
    assert first_bad_value(json.loads("[" * 64 + "]" * 64)) is None
    assert first_bad_value(json.loads("[" * 65 + "]" * 65)) is not None


async def test_over_http_64_levels_pass_the_check_and_65_are_a_400():
    client = await client_for(FakeWorld(FakeBehaviour(tokens=1)))
    try:
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/chat/completions", json={**chat, **levels(64)})
        assert "nesting too deep" not in await r.text()
        r = await client.post("/v1/chat/completions", json={**chat, **levels(65)})
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "invalid_value"
        assert err["param"] == "deep" + "[0]" * 63 and "at most 64 levels" in err["message"]
    finally:
        await client.close()
