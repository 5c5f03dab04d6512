"""Embeddings, rerank and tokenize over HTTP: real supervisor and worker processes, an
embedding model, an LM reranker, a cross-encoder reranker and a text model side by side,
through the official `openai` client where OpenAI defines the route."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.integration.conftest import assert_envelope
from tests.schema import validate
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "def main(): pass"]


@pytest.fixture(scope="module")
def ids(embed_model, reranker_model, cross_encoder_model, tiny_model):
    return {"embed": str(embed_model("bert")), "rerank": str(reranker_model),
            "cross": str(cross_encoder_model("xlm-roberta")), "text": str(tiny_model)}


@pytest.fixture(scope="module")
def server(ids):
    with ServerProcess(list(ids.values())) as srv:
        srv.wait_healthy()
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in resp.data], dtype=np.float32)


def test_embeddings_through_the_openai_client(client, http, ids):
    raw = http.post("/v1/embeddings", json={"model": ids["embed"], "input": TEXTS,
                                            "encoding_format": "float"})
    validate(raw.json(), "CreateEmbeddingResponse", strict=True)
    floats = client.embeddings.create(model=ids["embed"], input=TEXTS, encoding_format="float")
    # The client's default asks for base64 and decodes it: the same numbers.
    b64 = client.embeddings.create(model=ids["embed"], input=TEXTS)
    np.testing.assert_array_equal(vectors(floats), vectors(b64))
    assert vectors(floats).shape == (3, 64)
    np.testing.assert_array_equal(vectors(floats), np.array(
        [d["embedding"] for d in raw.json()["data"]], dtype=np.float32))  # deterministic
    singles = np.stack([vectors(client.embeddings.create(model=ids["embed"], input=t))[0]
                        for t in TEXTS])
    np.testing.assert_allclose(vectors(floats), singles, atol=2e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)

    short = vectors(client.embeddings.create(model=ids["embed"], input=TEXTS, dimensions=32))
    full = vectors(floats)[:, :32]
    np.testing.assert_allclose(short, full / np.linalg.norm(full, axis=1, keepdims=True),
                               atol=1e-6)
    by_ids = client.embeddings.create(model=ids["embed"], input=[[5, 6, 7], [8, 9]])
    assert len(by_ids.data) == 2 and by_ids.usage.prompt_tokens == 5


def test_embeddings_refusals_are_openai_errors(client, http, ids):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=ids["embed"], input="a", dimensions=20)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=ids["text"], input="a")
    assert e.value.body["param"] == "model" and "text generation" in e.value.body["message"]
    r = http.post("/v1/embeddings", json={"model": ids["embed"], "input": "word " * 600})
    assert_envelope(r, 400, "context_length_exceeded")
    r = http.post("/v1/embeddings", json={"model": ids["embed"], "input": [[10 ** 6]]})
    assert_envelope(r, 400)
    r = http.post("/v1/embeddings", json={"model": "no-such-model", "input": "a"})
    assert_envelope(r, 404)


@pytest.mark.parametrize("which", ["rerank", "cross"])
def test_rerank_is_deterministic_and_respects_top_n(http, ids, which):
    docs = ["mlx is an array framework", "bananas are yellow", "x", "Apple Silicon"]
    body = {"model": ids[which], "query": "what is mlx", "documents": docs}
    first = http.post("/v1/rerank", json=body).json()
    again = http.post("/v1/rerank", json=body).json()
    assert [r["index"] for r in first["results"]] == [r["index"] for r in again["results"]]
    assert sorted(r["index"] for r in first["results"]) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in first["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert first["usage"]["prompt_tokens"] > 0
    top = http.post("/v1/rerank", json={**body, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in first["results"][:2]]
    assert all("document" not in r for r in top["results"])
    # One document alone scores what it scored among the others.
    alone = http.post("/rerank", json={**body, "documents": [docs[2]]}).json()
    by_index = {r["index"]: r["relevance_score"] for r in first["results"]}
    assert alone["results"][0]["relevance_score"] == pytest.approx(by_index[2], abs=1e-5)
    r = http.post("/v1/rerank", json={"model": ids["embed"], "query": "q", "documents": ["d"]})
    assert_envelope(r, 400, "model_not_supported", "model")


def test_tokenize_counts_what_a_chat_completion_prefills(client, http, ids):
    messages = [{"role": "user", "content": "Count these tokens, please."}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    counted = http.post("/tokenize", json={"model": ids["text"], "messages": messages,
                                           "tools": tools, "return_token_strs": True}).json()
    chat = client.chat.completions.create(model=ids["text"], messages=messages, tools=tools,
                                          max_tokens=1)
    assert counted["count"] == chat.usage.prompt_tokens == len(counted["tokens"])
    assert "Count these tokens, please." in "".join(counted["token_strs"])
    assert counted["max_model_len"] == 4096
    back = http.post("/detokenize", json={"model": ids["text"],
                                          "tokens": counted["tokens"]}).json()
    assert "Count these tokens, please." in back["prompt"]
    plain = http.post("/tokenize", json={"model": ids["embed"], "prompt": "hello"}).json()
    assert plain["count"] == len(plain["tokens"]) >= 3  # [CLS] … [SEP]
    assert_envelope(http.post("/tokenize", json={"model": ids["text"]}), 400, param="prompt")


def test_models_list_each_kind(http, ids):
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert listed[ids["embed"]]["kind"] == "embed" and listed[ids["embed"]]["dimensions"] == 64
    assert listed[ids["rerank"]]["kind"] == listed[ids["cross"]]["kind"] == "rerank"
    assert listed[ids["cross"]]["context_length"] == 512
    assert listed[ids["text"]]["kind"] == "text"
    for m in listed.values():
        assert {"id", "object", "created", "owned_by", "context_length", "state"} <= set(m)
