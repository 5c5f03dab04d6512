"""The Conversations API end to end: the official `openai` client's conversations.* and
conversations.items.* against real processes, `conversation` on POST /v1/responses, a
restart, and the errors, every object checked against OpenAI's spec."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import assert_envelope
from tests.schema import validate
from tests.serverproc import ServerProcess


def said(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def dump(obj) -> dict:
    return obj.model_dump(exclude_unset=True)


def test_sdk_conversations_and_items(client):
    conv = client.conversations.create(metadata={"topic": "demo"},
                                       items=[said("one"), said("two")])
    validate(dump(conv), "ConversationResource", strict=True)
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"}
    assert client.conversations.retrieve(conv.id) == conv
    updated = client.conversations.update(conv.id, metadata={"topic": "other"})
    assert updated.metadata == {"topic": "other"} and updated.created_at == conv.created_at
    added = client.conversations.items.create(conv.id, items=[said("three"), said("four")])
    validate(dump(added), "ConversationItemList", strict=True)
    assert [i.content[0].text for i in added.data] == ["three", "four"]
    # Newest first by default; pages of 3 follow `after` to the end.
    first = client.conversations.items.list(conv.id, limit=3)
    validate(dump(first), "ConversationItemList", strict=True)
    assert [i.content[0].text for i in first.data] == ["four", "three", "two"]
    assert first.has_more and first.last_id == first.data[-1].id
    everything = [i.content[0].text
                  for i in client.conversations.items.list(conv.id, limit=3, order="asc")]
    assert everything == ["one", "two", "three", "four"]
    item = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    validate(dump(item), "ConversationItem", strict=True)
    assert item == added.data[0]
    after = client.conversations.items.delete(item.id, conversation_id=conv.id)
    validate(dump(after), "ConversationResource", strict=True)
    assert after.id == conv.id
    assert [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc")] \
        == ["one", "two", "four"]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(item.id, conversation_id=conv.id)
    gone = client.conversations.delete(conv.id)
    validate(dump(gone), "DeletedConversationResource", strict=True)
    assert gone.deleted and gone.id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_two_responses_in_a_row_share_the_conversation(client, model_id):
    conv = client.conversations.create(items=[said("Remember the number 7.")])
    r1 = client.responses.create(model=model_id, conversation=conv.id, input="Hi",
                                 max_output_tokens=4, temperature=0)
    validate(dump(r1), "Response")
    assert r1.conversation.id == conv.id
    # Streamed, and naming the conversation as an object this time.
    events = list(client.responses.create(model=model_id, conversation={"id": conv.id},
                                          input="More", max_output_tokens=4, stream=True))
    r2 = events[-1].response
    # The second saw the whole conversation: its prompt holds the first turn's output.
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    items = list(client.conversations.items.list(conv.id, order="asc"))
    for i in items:
        validate(dump(i), "ConversationItem")
    assert [(i.type, i.role) for i in items] == [("message", "user")] * 2 + [
        ("message", "assistant"), ("message", "user"), ("message", "assistant")]
    assert [items[2].id, items[4].id] == [r1.output[0].id, r2.output[0].id]
    assert items[4].content[0].text == r2.output_text
    # A response that does not finish adds nothing: a background one, cancelled.
    bg = client.responses.create(model=model_id, conversation=conv.id, input="Long",
                                 max_output_tokens=3000, background=True)
    assert client.responses.cancel(bg.id).status == "cancelled"
    assert len(list(client.conversations.items.list(conv.id))) == 5


def sdk(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_a_conversation_survives_a_restart(tiny_model, tmp_path):
    model = str(tiny_model)
    with ServerProcess([model], state_dir=tmp_path) as srv:
        srv.wait_healthy()
        conv = sdk(srv).conversations.create(metadata={"n": "1"})
        r1 = sdk(srv).responses.create(model=model, conversation=conv.id, input="Hi",
                                       max_output_tokens=4)
    with ServerProcess([model], state_dir=tmp_path) as srv:
        srv.wait_healthy()
        oai = sdk(srv)
        assert oai.conversations.retrieve(conv.id) == conv
        items = list(oai.conversations.items.list(conv.id, order="asc"))
        assert [i.role for i in items] == ["user", "assistant"]
        assert items[1].content[0].text == r1.output_text
        r2 = oai.responses.create(model=model, conversation=conv.id, input="Again",
                                  max_output_tokens=4)
        assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
        # The new process's memory holds no state: the turn resumed from the first
        # response's KV snapshot, read from the disk tier (worker/kvcache/snapshots.py).
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens


@pytest.mark.parametrize("method,path,body,param", [
    ("GET", "/v1/conversations/conv_nope", None, "conversation_id"),
    ("POST", "/v1/conversations/conv_nope", {"metadata": {}}, "conversation_id"),
    ("DELETE", "/v1/conversations/conv_nope", None, "conversation_id"),
    ("GET", "/v1/conversations/conv_nope/items", None, "conversation_id"),
    ("POST", "/v1/conversations/conv_nope/items", {"items": [said("x")]}, "conversation_id"),
    ("GET", "/v1/conversations/conv_nope/items/msg_1", None, "conversation_id"),
    ("DELETE", "/v1/conversations/conv_nope/items/msg_1", None, "conversation_id"),
])
def test_unknown_ids_are_404(http, method, path, body, param):
    assert_envelope(http.request(method, path, json=body), 404, "not_found", param)


def test_unknown_items_and_conversations_on_responses_are_404(http, model_id):
    cid = http.post("/v1/conversations", json={}).json()["id"]
    for method in ("GET", "DELETE"):
        assert_envelope(http.request(method, f"/v1/conversations/{cid}/items/msg_nope"), 404,
                        "not_found", "item_id")
    r = http.post("/v1/responses", json={"model": model_id, "input": "x",
                                         "conversation": "conv_nope"})
    assert_envelope(r, 404, "not_found", "conversation")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/conversations", {"items": "hello"}, "items"),
    ("/v1/conversations", {"items": [said("x")] * 21}, "items"),
    ("/v1/conversations", {"items": [{"type": "nonsense"}]}, "items[0].type"),
    ("/v1/conversations", {"items": [{"role": "user", "content": 5}]}, "items[0].content"),
    ("/v1/conversations", {"metadata": "x"}, "metadata"),
    ("/v1/conversations", {"items": [{**said("a"), "id": "m1"}, {**said("b"), "id": "m1"}]},
     "items"),
    ("{conv}", {}, "metadata"),
    ("{conv}", {"metadata": {"k": 1}}, "metadata.k"),
    ("{conv}/items", {}, "items"),
    ("{conv}/items", {"items": [said("x")] * 21}, "items"),
])
def test_bad_bodies_are_400(http, path, body, param):
    conv = http.post("/v1/conversations", json={}).json()
    r = http.post(path.format(conv=f"/v1/conversations/{conv['id']}"), json=body)
    assert_envelope(r, 400, param=param)


@pytest.mark.parametrize("extra,param", [
    ({"conversation": 5}, "conversation"),
    ({"conversation": {"name": "x"}}, "conversation.id"),
    ({"previous_response_id": "resp_x"}, "conversation"),
    ({"input": [{**said("again"), "id": "m1"}]}, "input[0].id"),
])
def test_bad_conversation_on_responses_is_400(http, model_id, extra, param):
    conv = http.post("/v1/conversations", json={"items": [{**said("a"), "id": "m1"}]}).json()
    body = {"model": model_id, "input": "x", "conversation": conv["id"], "max_output_tokens": 4,
            **extra}
    assert_envelope(http.post("/v1/responses", json=body), 400, param=param)
    items = http.get(f"/v1/conversations/{conv['id']}/items").json()
    assert [i["id"] for i in items["data"]] == ["m1"]  # nothing ran, nothing was added
