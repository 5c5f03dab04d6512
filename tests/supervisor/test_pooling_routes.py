"""/v1/embeddings, /v1/rerank, /tokenize and /detokenize over HTTP against the fake
worker: validation in OpenAI's envelope, the task a model's kind cannot do refused at
admission, results carried back through the one request lifecycle (api/lifecycle.py)."""

from __future__ import annotations

import base64
import struct

import pytest

from protocol import ModelKind, Task
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for


async def _client(kind: ModelKind):
    return await client_for(FakeWorld(FakeBehaviour(model_kind=kind)))


async def _error(resp, status: int, param: str | None = None) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


async def test_embeddings_return_rows_in_input_order_with_usage():
    client = await _client(ModelKind.EMBED)
    try:
        r = await client.post("/v1/embeddings", json={"model": "fake", "input": ["ab", "cdef"]})
        body = await r.json()
        assert r.status == 200, body
        assert body["object"] == "list" and body["model"] == "fake"
        assert [d["index"] for d in body["data"]] == [0, 1]
        # The fake's rows are [length, index]: each row is its own input's.
        assert [d["embedding"] for d in body["data"]] == [[2.0, 0.0], [4.0, 1.0]]
        assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
        r = await client.post("/v1/embeddings", json={"model": "fake", "input": ["ab", "cdef"],
                                                      "encoding_format": "base64"})
        rows = [struct.unpack("<2f", base64.b64decode(d["embedding"]))
                for d in (await r.json())["data"]]
        assert rows == [(2.0, 0.0), (4.0, 1.0)]
    finally:
        await client.close()


@pytest.mark.parametrize("body,param", [
    ({"input": "x"}, "model"),
    ({"model": "fake"}, "input"),
    ({"model": "fake", "input": []}, "input"),
    ({"model": "fake", "input": [""]}, "input[0]"),
    ({"model": "fake", "input": ["a", 1]}, "input"),
    ({"model": "fake", "input": [[1, 2], []]}, "input[1]"),
    ({"model": "fake", "input": [-1]}, "input[0]"),
    ({"model": "fake", "input": ["a"] * 2049}, "input"),
    ({"model": "fake", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "fake", "input": "a", "dimensions": 0}, "dimensions"),
    ({"model": "fake", "input": "a", "dimensions": True}, "dimensions"),
])
async def test_bad_embeddings_bodies_are_400s_naming_the_param(body, param):
    client = await _client(ModelKind.EMBED)
    try:
        await _error(await client.post("/v1/embeddings", json=body), 400, param)
    finally:
        await client.close()


async def test_a_task_the_model_cannot_do_is_refused_naming_the_model():
    client = await _client(ModelKind.TEXT)
    try:
        err = await _error(await client.post("/v1/embeddings", json={
            "model": "fake", "input": "x"}), 400, "model")
        assert err["code"] == "model_not_supported" and "text generation model" in err["message"]
        err = await _error(await client.post("/v1/rerank", json={
            "model": "fake", "query": "q", "documents": ["d"]}), 400, "model")
        assert "cannot rerank" in err["message"]
    finally:
        await client.close()
    client = await _client(ModelKind.EMBED)
    try:
        err = await _error(await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}]}), 400, "model")
        assert "embedding model" in err["message"] and "cannot generate" in err["message"]
    finally:
        await client.close()


async def test_rerank_orders_best_first_and_respects_top_n():
    client = await _client(ModelKind.RERANK)
    docs = ["aa", "a", "aaaa", "aaa"]  # the fake scores a document by its length
    try:
        r = await client.post("/v1/rerank", json={"model": "fake", "query": "q",
                                                  "documents": docs, "top_n": 3})
        body = await r.json()
        assert r.status == 200, body
        assert [x["index"] for x in body["results"]] == [2, 3, 0]
        assert [x["document"]["text"] for x in body["results"]] == ["aaaa", "aaa", "aa"]
        scores = [x["relevance_score"] for x in body["results"]]
        assert scores == sorted(scores, reverse=True)
        r = await client.post("/rerank", json={
            "model": "fake", "query": "q", "return_documents": False,
            "documents": [{"text": "b"}, {"text": "bb"}]})
        body = await r.json()
        assert [x["index"] for x in body["results"]] == [1, 0]
        assert all("document" not in x for x in body["results"])
    finally:
        await client.close()


@pytest.mark.parametrize("body,param", [
    ({"model": "fake", "documents": ["d"]}, "query"),
    ({"model": "fake", "query": "", "documents": ["d"]}, "query"),
    ({"model": "fake", "query": "q"}, "documents"),
    ({"model": "fake", "query": "q", "documents": []}, "documents"),
    ({"model": "fake", "query": "q", "documents": [3]}, "documents[0]"),
    ({"model": "fake", "query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
])
async def test_bad_rerank_bodies_are_400s_naming_the_param(body, param):
    client = await _client(ModelKind.RERANK)
    try:
        await _error(await client.post("/v1/rerank", json=body), 400, param)
    finally:
        await client.close()


async def test_tokenize_sends_the_tokenize_task_and_returns_its_ids():
    world = FakeWorld(FakeBehaviour())
    client = await client_for(world)
    try:
        r = await client.post("/tokenize", json={"model": "fake", "prompt": "hé"})
        body = await r.json()
        assert r.status == 200, body
        assert body["tokens"] == list("hé".encode()) and body["count"] == 3
        assert body["max_model_len"] == 128
        sent = [m for m in world.received if getattr(m, "task", None) is Task.TOKENIZE]
        assert len(sent) == 1 and sent[0].prompt == "hé"
        # With messages, the chat request as a chat completion would send it.
        r = await client.post("/tokenize", json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]})
        assert r.status == 200, await r.text()
        sent = [m for m in world.received if getattr(m, "task", None) is Task.TOKENIZE]
        assert sent[-1].messages == [{"role": "user", "content": "hi"}]
        assert sent[-1].output.tools[0]["function"]["name"] == "f"
        await _error(await client.post("/tokenize", json={"model": "fake"}), 400, "prompt")
        await _error(await client.post("/tokenize", json={
            "model": "fake", "messages": []}), 400, "messages")
        await _error(await client.post("/detokenize", json={
            "model": "fake", "tokens": ["a"]}), 400, "tokens")
        await _error(await client.post("/detokenize", json={
            "model": "fake", "tokens": [2 ** 32]}), 400, "tokens[0]")
    finally:
        await client.close()
