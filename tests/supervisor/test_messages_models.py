"""/v1/models in Anthropic's shape (api/messages/models.py) against the fake worker: an
`anthropic-version` request gets ModelInfo objects (checked by the anthropic SDK's own
type) with the model's window as `max_input_tokens`, Anthropic's paging, only models that
serve Messages, and `x-api-key` taken as the key; without the header the OpenAI list is
unchanged."""

from __future__ import annotations

import anthropic.types
import pytest

from protocol import ModelKind
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for

ANTHROPIC = {"anthropic-version": "2023-06-01"}


async def _client(kind: ModelKind = ModelKind.TEXT, **cfg):
    client = await client_for(FakeWorld(FakeBehaviour(model_kind=kind, context_length=2048)),
                              **cfg)
    await client.post("/v1/completions", json={"model": "fake", "prompt": "x",
                                                "max_tokens": 1})  # loaded: its window known
    return client


async def test_anthropic_clients_get_model_info_with_the_window():
    client = await _client()
    try:
        body = await (await client.get("/v1/models", headers=ANTHROPIC)).json()
        assert set(body) == {"data", "has_more", "first_id", "last_id"}
        assert body["has_more"] is False and body["first_id"] == body["last_id"] == "fake"
        [info] = body["data"]
        anthropic.types.ModelInfo.model_validate(info, strict=False)
        assert info["type"] == "model" and info["id"] == "fake" and info["state"] == "ready"
        assert info["max_input_tokens"] == info["max_tokens"] == 2048
        one = await (await client.get("/v1/models/fake", headers=ANTHROPIC)).json()
        assert one == info
        openai_body = await (await client.get("/v1/models")).json()  # no header: unchanged
        assert openai_body["object"] == "list" and openai_body["data"][0]["object"] == "model"
        assert "max_input_tokens" not in openai_body["data"][0]
    finally:
        await client.close()


@pytest.mark.parametrize("query,status", [("limit=0", 400), ("limit=1001", 400),
                                          ("limit=x", 400), ("limit=1", 200),
                                          ("after_id=fake", 200), ("before_id=fake", 200)])
async def test_paging(query, status):
    client = await _client()
    try:
        r = await client.get(f"/v1/models?{query}", headers=ANTHROPIC)
        body = await r.json()
        assert r.status == status, body
        if status == 400:
            assert body["error"]["param"] == "limit"
        elif "_id" in query:  # nothing after or before the only model
            assert body == {"data": [], "has_more": False, "first_id": None, "last_id": None}
        else:
            assert [m["id"] for m in body["data"]] == ["fake"]
    finally:
        await client.close()


async def test_a_model_that_does_not_serve_messages_is_not_listed():
    client = await _client(ModelKind.EMBED)
    try:
        body = await (await client.get("/v1/models", headers=ANTHROPIC)).json()
        assert body["data"] == []
        r = await client.get("/v1/models/fake", headers=ANTHROPIC)
        assert r.status == 404 and "does not serve the Messages" in (await r.text())
        assert (await client.get("/v1/models/fake")).status == 200  # OpenAI's view lists it
    finally:
        await client.close()


async def test_x_api_key_is_a_key_on_the_models_route():
    client = await _client(api_key=("k3y",))
    try:
        assert (await client.get("/v1/models", headers=ANTHROPIC)).status == 401
        r = await client.get("/v1/models", headers={**ANTHROPIC, "x-api-key": "k3y"})
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake"
        r = await client.get("/v1/models", headers={**ANTHROPIC, "x-api-key": "wrong"})
        assert r.status == 401
    finally:
        await client.close()
