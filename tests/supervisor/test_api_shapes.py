"""Response shapes: each builder validates against the vendored OpenAI spec and parses with
the official `openai` SDK types without losing or adding fields; the SDK's own stream
reader accepts our SSE bytes end to end (over an in-memory httpx transport)."""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
from openai._models import construct_type  # what the SDK's stream reader uses
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from supervisor.api import lifecycle
from supervisor.api import models
from supervisor.api.chat import shapes
from supervisor.api.completions import shapes as text_shapes
from supervisor.http import sse
from supervisor.http.errors import APIError
from tests.schema import validate

U = lifecycle.usage(12, 5, cached_tokens=8)


def sdk_parse(cls, obj: dict, allow_extra: bool = False):
    """Validate with the SDK's pydantic type; the dump must give back exactly our dict
    (nothing lost), and unless allowed no level may hold keys the SDK does not know."""
    parsed = cls.model_validate(obj)
    assert parsed.model_dump(mode="json", exclude_unset=True) == obj
    if not allow_extra:
        _assert_no_extra(parsed, cls.__name__)
    return parsed


def _assert_no_extra(value, where: str) -> None:
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{where}: unknown to the SDK: {value.model_extra}"
        for name in type(value).model_fields:
            _assert_no_extra(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _assert_no_extra(item, f"{where}[{i}]")


# ---- builders against the spec and the SDK types -------------------------------------

def test_usage():
    assert U == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
                 "prompt_tokens_details": {"cached_tokens": 8},
                 "completion_tokens_details": {"reasoning_tokens": 0,
                                               "accepted_prediction_tokens": 0,
                                               "rejected_prediction_tokens": 0}}
    validate(U, "CompletionUsage", strict=True)


def test_ids():
    assert shapes.new_chat_id().startswith("chatcmpl-")
    assert text_shapes.new_completion_id().startswith("cmpl-")
    assert shapes.new_chat_id() != shapes.new_chat_id()


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls", "cancelled"])
def test_chat_completion(reason):
    obj = shapes.chat_completion("chatcmpl-abc", 1700000000, "m", "Hello!", reason, U)
    validate(obj, "CreateChatCompletionResponse", strict=True)
    parsed = sdk_parse(ChatCompletion, obj)
    assert parsed.choices[0].message.content == "Hello!"
    assert parsed.choices[0].message.refusal is None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8
    assert obj["choices"][0]["finish_reason"] == shapes.chat_finish_reason(reason)


def test_chat_completion_optional_parts():
    obj = shapes.chat_completion("chatcmpl-abc", 1, "m", None, "stop", None,
                                 system_fingerprint="fp_mlxd")
    assert "usage" not in obj and obj["choices"][0]["message"]["content"] is None
    validate(obj, "CreateChatCompletionResponse", strict=True)
    sdk_parse(ChatCompletion, obj)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks(include_usage):
    chunks = [
        shapes.chat_first_chunk("chatcmpl-x", 5, "m", include_usage=include_usage),
        shapes.chat_chunk("chatcmpl-x", 5, "m", {"content": "Hel"}, include_usage=include_usage),
        shapes.chat_chunk("chatcmpl-x", 5, "m", {}, "length", include_usage=include_usage),
    ]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for chunk in chunks:
        assert ("usage" in chunk) is include_usage and chunk.get("usage") is None
        validate(chunk, "CreateChatCompletionStreamResponse", strict=True)
        sdk_parse(ChatCompletionChunk, chunk)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_chat_usage_chunk():
    chunk = shapes.chat_usage_chunk("chatcmpl-x", 5, "m", U)
    assert chunk["choices"] == [] and chunk["usage"] == U
    validate(chunk, "CreateChatCompletionStreamResponse", strict=True)
    sdk_parse(ChatCompletionChunk, chunk)


@pytest.mark.parametrize("reason,wire", [("stop", "stop"), ("length", "length"),
                                         ("cancelled", "length"), ("tool_calls", "stop")])
def test_text_completion(reason, wire):
    obj = text_shapes.text_completion("cmpl-abc", 1, "m", " there", reason, U)
    assert obj["choices"][0]["finish_reason"] == wire
    validate(obj, "CreateCompletionResponse", strict=True)
    sdk_parse(Completion, obj)


def test_completion_chunks():
    final = text_shapes.completion_chunk("cmpl-x", 1, "m", "", "stop")
    validate(final, "CreateCompletionResponse", strict=True)
    sdk_parse(Completion, final)
    # Intermediate chunks carry finish_reason null, as the real API sends them; the spec
    # (no separate chunk schema, finish_reason not nullable) and the SDK's strict pydantic
    # type both reject that null, so check all the rest strictly and the null itself with
    # the lenient constructor the SDK's stream reader really uses.
    chunk = text_shapes.completion_chunk("cmpl-x", 1, "m", "Hi")
    assert chunk["choices"][0]["finish_reason"] is None
    as_final = copy.deepcopy(chunk)
    as_final["choices"][0]["finish_reason"] = "stop"
    validate(as_final, "CreateCompletionResponse", strict=True)
    sdk_parse(Completion, as_final)
    built = construct_type(type_=Completion, value=chunk)
    assert built.choices[0].text == "Hi" and built.choices[0].finish_reason is None
    usage_chunk = text_shapes.completion_usage_chunk("cmpl-x", 1, "m", U)
    validate(usage_chunk, "CreateCompletionResponse", strict=True)
    sdk_parse(Completion, usage_chunk)


def _output(text: str, logprobs=()):
    from supervisor.api.output import Output, Part

    out = Output()
    out.add(Part(text=text, logprobs=list(logprobs)))
    return out


def test_choices_of_one_chat_completion():
    """`n` choices: each its own index, message and finish reason, in one body; each
    choice's chunks (role, content, finish) carry its index."""
    objects = shapes.ChatShapes("chatcmpl-n", 1, "m", include_usage=False)
    body = objects.body([(_output("a"), "stop"), (_output("b"), "length"),
                         (_output(""), "cancelled")], U)
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in body["choices"]] == [(0, "a", "stop"), (1, "b", "length"),
                                          (2, "", "length")]
    validate(body, "CreateChatCompletionResponse", strict=True)
    sdk_parse(ChatCompletion, body)
    from supervisor.api.output import Part

    chunks = [objects.first_chunk(2), *objects.chunks(Part(text="x"), 2),
              objects.final_chunk("stop", 2)]
    assert [c["choices"][0]["index"] for c in chunks] == [2, 2, 2]
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse", strict=True)
        sdk_parse(ChatCompletionChunk, chunk)


def test_choices_of_one_text_completion():
    """Several choices (a batch of prompts, `n`): indexes in order; each choice's
    logprobs' text offsets count that choice's own text, streamed or whole."""
    from supervisor.api.output import Part, TokenLogprob

    def lp(token):
        return TokenLogprob(token, -0.5, list(token.encode()), [])

    objects = text_shapes.CompletionShapes("cmpl-n", 1, "m", logprobs=True)
    body = objects.body([(_output("ab", [lp("a"), lp("b")]), "stop"),
                         (_output("c", [lp("c")]), "length")], U)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ab", "stop"), (1, "c", "length")]
    assert body["choices"][1]["logprobs"]["text_offset"] == [0]
    validate(body, "CreateCompletionResponse", strict=True)
    sdk_parse(Completion, body)
    first = objects.chunks(Part(text="ab", logprobs=[lp("a"), lp("b")]), 0)
    other = objects.chunks(Part(text="c", logprobs=[lp("c")]), 1)
    again = objects.chunks(Part(text="d", logprobs=[lp("d")]), 0)
    assert [c["choices"][0]["index"] for c in first + other + again] == [0, 1, 0]
    assert other[0]["choices"][0]["logprobs"]["text_offset"] == [0]
    assert again[0]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert objects.final_chunk("stop", 1)["choices"][0]["index"] == 1


def test_models():
    plain = models.model_object("tiny", 1700000000, "mlxd")
    validate(plain, "Model", strict=True)
    sdk_parse(Model, plain)
    extra = models.model_object("tiny", 1, "mlxd", context_length=4096, state="ready")
    validate(extra, "Model")
    assert sdk_parse(Model, extra, allow_extra=True).model_extra == {
        "context_length": 4096, "state": "ready"}
    listing = models.model_list(iter([plain, extra]))
    validate(listing, "ListModelsResponse")
    validate(models.model_list([plain]), "ListModelsResponse", strict=True)
    assert listing == {"object": "list", "data": [plain, extra]}


def test_error_envelope_matches_spec():
    for err in (APIError.bad_request("x", "messages"), APIError.internal(),
                APIError.model_not_found("nope"), APIError.overloaded("busy", 2)):
        validate(err.to_envelope(), "ErrorResponse", strict=True)


def test_finish_reason_error_is_not_a_wire_value():
    for mapping in (shapes.chat_finish_reason, text_shapes.text_finish_reason):
        with pytest.raises(ValueError):
            mapping("error")
    with pytest.raises(ValueError):
        shapes.chat_completion("chatcmpl-1", 1, "m", "", "error", U)


# ---- the official client over our bytes ------------------------------------------------

def sdk_client(routes: dict) -> openai.OpenAI:
    """An OpenAI client whose HTTP goes to an in-memory transport serving `routes`:
    path -> (status, content_type, body bytes)."""
    def handle(request: httpx.Request) -> httpx.Response:
        status, ctype, body = routes[request.url.path]
        return httpx.Response(status, headers={"content-type": ctype}, content=body)
    return openai.OpenAI(api_key="x", base_url="http://test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handle)))


def sse_body(*events: dict, done: bool = True, tail: bytes = b"") -> bytes:
    return b"".join(sse.encode_event(e) for e in events) + tail + (sse.DONE if done else b"")


def test_sdk_reads_chat_stream():
    cid = "chatcmpl-s"
    body = sse_body(
        shapes.chat_first_chunk(cid, 1, "m", include_usage=True),
        shapes.chat_chunk(cid, 1, "m", {"content": "Hel"}, include_usage=True),
        shapes.chat_chunk(cid, 1, "m", {"content": "lo\n"}, include_usage=True),
        shapes.chat_chunk(cid, 1, "m", {}, "stop", include_usage=True),
        shapes.chat_usage_chunk(cid, 1, "m", U),
        tail=sse.PING,  # comments must be skipped by the client
    )
    client = sdk_client({"/v1/chat/completions": (200, "text/event-stream", body)})
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello\n"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 17


def test_sdk_reads_completion_stream_and_bodies():
    body = sse_body(text_shapes.completion_chunk("cmpl-s", 1, "m", "Hi"),
                    text_shapes.completion_chunk("cmpl-s", 1, "m", " there", "length"))
    chat = shapes.chat_completion("chatcmpl-w", 1, "m", "Hello", "stop", U)
    listing = models.model_list([models.model_object("tiny", 1, "mlxd", context_length=8)])
    client = sdk_client({
        "/v1/completions": (200, "text/event-stream", body),
        "/v1/chat/completions": (200, "application/json", json.dumps(chat).encode()),
        "/v1/models": (200, "application/json", json.dumps(listing).encode()),
    })
    chunks = list(client.completions.create(model="m", prompt="x", stream=True))
    assert [c.choices[0].text for c in chunks] == ["Hi", " there"]
    assert [c.choices[0].finish_reason for c in chunks] == [None, "length"]
    got = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "h"}])
    assert got.choices[0].message.content == "Hello" and got.usage.completion_tokens == 5
    listed = list(client.models.list())
    assert listed[0].id == "tiny" and listed[0].model_extra["context_length"] == 8


def test_sdk_raises_mid_stream_error_event():
    err = APIError.worker_failed("The model worker stopped while generating; please retry.")
    body = sse_body(shapes.chat_first_chunk("chatcmpl-e", 1, "m"),
                    shapes.chat_chunk("chatcmpl-e", 1, "m", {"content": "partial"}),
                    done=False, tail=sse.error_event(err))
    client = sdk_client({"/v1/chat/completions": (200, "text/event-stream", body)})
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    seen = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["", "partial"]
    assert "worker stopped" in info.value.message
    assert info.value.body["code"] == "worker_failed"


def test_sdk_reads_error_envelope():
    err = APIError.model_not_found("nope")
    client = sdk_client({"/v1/chat/completions": (
        err.status, "application/json", json.dumps(err.to_envelope()).encode())})
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "h"}])
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert "The model `nope` does not exist" in info.value.message
