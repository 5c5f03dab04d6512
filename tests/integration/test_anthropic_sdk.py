"""The official `anthropic` SDK's own helpers on a real server: its tool loop
(`client.beta.messages.tool_runner`, which threads its requests by itself) and its thread
helper over Anthropic's message threads (each later request sends only its new messages,
and the reply is the one the whole conversation gets without a thread), the runner's
compaction (`compact_before_next_turn()`), and its structured outputs
(`messages.parse(output_format=...)`, streamed too). The model is the
tiny Qwen3-Coder-template one that ends its replies after one token (tests/openresponses/
model.py); `tool_choice: any` makes every turn a grammar-built tool call, whose bounded
arguments keep it short."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import anthropic
import httpx2
import pytest
from anthropic import beta_tool
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration

BETA = "message-threads-2026-08-12"


@pytest.fixture
def sdk(stopping_server):
    """(client, the bodies it sent, in order)."""
    sent: list[dict] = []

    def record(request):
        if request.url.path == "/v1/messages":
            sent.append(json.loads(request.content))

    client = anthropic.Anthropic(base_url=stopping_server.url, api_key="unused", max_retries=0,
                                 http_client=httpx2.Client(event_hooks={"request": [record]},
                                                           timeout=120))
    yield client, sent
    client.close()


def weather_runner(client, server, calls: list, stream: bool):
    """The SDK's tool runner on a weather tool that records its calls: every turn must
    call it (three at most), greedy."""

    @beta_tool
    def get_weather(city: Annotated[str, Field(max_length=12)],
                    days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city for some days.

        Args:
            city: the city
            days: how many days
        """
        calls.append((city, days))
        return json.dumps({"temp": 21, "days": days})

    return client.beta.messages.tool_runner(
        model=server.model, max_tokens=200, system="Use the tools.",
        tools=[get_weather], tool_choice={"type": "any"}, max_iterations=3, stream=stream,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_body={"temperature": 0})  # (the runner has no such parameter any more)


@pytest.mark.parametrize("stream", [False, True])
def test_the_sdks_tool_runner_threads_its_loop_through_mlxd(sdk, stopping_server, stream):
    client, sent = sdk
    calls = []
    runner = weather_runner(client, stopping_server, calls, stream)
    replies = [turn.get_final_message() if stream else turn for turn in runner]
    assert len(replies) == 3 and len(calls) == 3
    assert all(r.stop_reason == "tool_use" for r in replies)
    # The first request created the thread with everything; each later one continued
    # from the reply before it with only the tool's result, no system prompt, no tools.
    assert sent[0]["thread"] == {"type": "create"} and "tools" in sent[0]
    for before, body, reply in zip(replies, sent[1:], replies[1:]):
        assert body["thread"] == {"type": "continue", "previous_message_id": before.id}
        assert "system" not in body and "tools" not in body
        [message] = body["messages"]
        assert [b["type"] for b in message["content"]] == ["tool_result"]
        assert message["content"][0]["tool_use_id"] == before.content[-1].id
        # mlxd served the whole conversation: all of it but the new result came from the
        # prefix cache.
        assert reply.usage.cache_read_input_tokens > reply.usage.input_tokens > 0
    # What the last turn got is what the whole conversation gets without a thread.
    whole = list(sent[0]["messages"])
    for reply, body in zip(replies, sent[1:]):
        whole += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                  *body["messages"]]
    plain = client.messages.create(model=stopping_server.model, max_tokens=200,
                                   system="Use the tools.", tools=sent[0]["tools"],
                                   tool_choice={"type": "any"}, messages=whole,
                                   extra_body={"temperature": 0})
    assert [(b.type, b.name, b.input) for b in plain.content] == [
        (b.type, b.name, b.input) for b in replies[-1].content]
    assert (plain.usage.input_tokens + plain.usage.cache_read_input_tokens
            == replies[-1].usage.input_tokens + replies[-1].usage.cache_read_input_tokens)


def test_a_thread_continues_once_and_an_unknown_one_is_not_found(sdk, stopping_server):
    client, sent = sdk
    thread = client.beta.messages.thread(model=stopping_server.model, max_tokens=8,
                                         system="Answer briefly.")
    first = thread.send({"role": "user", "content": "Hello"})
    second = thread.send({"role": "user", "content": "And then?"})
    assert sent[-1]["thread"] == {"type": "continue", "previous_message_id": first.id}
    assert [m["content"] for m in sent[-1]["messages"]] == ["And then?"]
    assert second.stop_reason == "end_turn"

    def again(previous: str):
        return client.beta.messages.create(
            model=stopping_server.model, max_tokens=8, betas=[BETA],
            messages=[{"role": "user", "content": "Once more"}],
            thread={"type": "continue", "previous_message_id": previous})

    # The SDK reads the cause from `error.details.error_code`: a client replays on both.
    with pytest.raises(anthropic.BadRequestError) as e:
        again(first.id)
    assert e.value.error_code == "thread_already_continued"
    with pytest.raises(anthropic.NotFoundError) as e:
        again("msg_" + "0" * 32)
    assert e.value.error_code == "thread_not_found"
    third = again(second.id)
    assert third.usage.cache_read_input_tokens > 0


class Report(BaseModel):
    # (Bounded: the SDK moves a string's maxLength into its description, and a random
    # model's free string runs to max_tokens.)
    city: Literal["Paris", "Rome", "Oslo"]
    warm: bool


@pytest.mark.parametrize("how", ["parse", "stream", "beta"])
def test_structured_output_follows_the_sdks_schema(sdk, stopping_server, how):
    client, sent = sdk
    ask = {"model": stopping_server.model, "max_tokens": 100, "output_format": Report,
           "messages": [{"role": "user", "content": "Paris?"}],
           "extra_body": {"temperature": 0}}
    if how == "stream":
        with client.messages.stream(**ask) as stream:
            message = stream.get_final_message()
    else:
        message = (client.beta.messages if how == "beta" else client.messages).parse(**ask)
    assert isinstance(message.parsed_output, Report)
    assert message.stop_reason == "end_turn"
    assert sent[-1]["output_config"]["format"]["type"] == "json_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_the_tool_runner_compacts_through_mlxd_and_goes_on(sdk, stopping_server, stream):
    client, sent = sdk
    runner = weather_runner(client, stopping_server, [], stream)
    replies = []
    for turn in runner:
        replies.append(turn.get_final_message() if stream else turn)
        if len(replies) == 1:
            runner.compact_before_next_turn()
    assert [r.stop_reason for r in replies] == ["tool_use", "compaction", "tool_use",
                                                "tool_use"]
    [block] = replies[1].content
    # The summary heads with what is written, not generated: the user's request.
    assert block.type == "compaction" and "Task: Weather in Paris?" in block.content
    asked = next(b for b in sent if "compaction" in b)
    assert asked["compaction"] == {"type": "summarize"}
    assert [m["role"] for m in asked["messages"]] == ["user", "assistant", "user"]
    # The runner went on from the summary alone: its history is the compaction block.
    after = sent[sent.index(asked) + 1]
    assert [[b["type"] for b in m["content"]] for m in after["messages"]] == [["compaction"]]
    assert after["messages"][0]["content"][0]["content"] == block.content
