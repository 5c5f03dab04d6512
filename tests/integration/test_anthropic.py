"""The Anthropic Messages API end to end: real supervisor and worker processes, the
official `anthropic` client, a tiny model with a real tool-calling family's template
(Qwen/Hermes: tools, <tool_call>, <think>). Every body and stream event is checked against
Anthropic's shapes (tests/anthropic/shapes.json)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from tests.anthropic.shapes import validate, validate_event

pytestmark = pytest.mark.integration

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def qwen(qwen_server, family_model):
    return qwen_server, str(family_model("qwen"))


@pytest.fixture
def client(qwen) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen[0].url, api_key="unused", max_retries=0)


def raw_events(srv, body: dict) -> list[tuple[str, dict]]:
    """The stream's events as sent (name, data), each validated."""
    events, name = [], None
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        with http.stream("POST", "/v1/messages", json={**body, "stream": True},
                         headers={"anthropic-version": "2023-06-01"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    validate_event(name, data)
                    events.append((name, data))
    return events


def test_a_message_whole_and_streamed(client, qwen):
    srv, model = qwen
    # (temperature rides as an extra field: this SDK's create() no longer takes it)
    body = {"model": model, "max_tokens": 8, "thinking": NO_THINKING,
            "messages": [{"role": "user", "content": "Say hello."}]}
    greedy = {"extra_body": {"temperature": 0}}
    msg = client.messages.create(**body, **greedy)
    validate(msg.model_dump(exclude_unset=True, exclude_none=True), "Message")
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 8
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    events = raw_events(srv, {**body, "temperature": 0})
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == msg.content[0].text  # temperature 0: the same answer either way
    with client.messages.stream(**body, **greedy) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"


def test_stop_sequences_end_the_text_and_are_named(client, qwen):
    _, model = qwen
    body = {"model": model, "max_tokens": 12, "thinking": NO_THINKING,
            "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "Tell me something."}]}
    text = client.messages.create(**body).content[0].text
    stop = text[3:6]
    assert len(stop) == 3
    cut = client.messages.create(**body, stop_sequences=["never-there", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == text[:text.find(stop)]


def test_tool_use_round_trip(client, qwen):
    _, model = qwen
    first = client.messages.create(
        model=model, max_tokens=200, thinking=NO_THINKING, tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}])
    validate(first.model_dump(exclude_unset=True, exclude_none=True), "Message")
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    follow = client.messages.create(
        model=model, max_tokens=6, thinking=NO_THINKING, tools=[WEATHER], messages=[
            {"role": "user", "content": "Weather in Paris for 3 days?"},
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": [{"type": "text", "text": "21C"}]}]}])
    assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use")
    seen = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert seen(follow) > seen(first) + first.usage.output_tokens


def test_streamed_tool_input_arrives_as_json_fragments(qwen):
    srv, model = qwen
    events = raw_events(srv, {
        "model": model, "max_tokens": 200, "thinking": NO_THINKING, "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Weather?"}]})
    start = next(d for n, d in events if n == "content_block_start"
                 and d["content_block"]["type"] == "tool_use")
    fragments = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
                 and d["index"] == start["index"]]
    jsonschema.validate(json.loads("".join(fragments)), WEATHER["input_schema"])
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert "<tool_call>" not in json.dumps(events)


def test_thinking_comes_as_signed_thinking_blocks(client, qwen):
    srv, model = qwen
    body = {"model": model, "max_tokens": 12,
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "messages": [{"role": "user", "content": "Think first."}]}
    msg = client.messages.create(**body)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking
    assert msg.content[0].signature and "<think>" not in msg.content[0].thinking
    events = raw_events(srv, body)
    kinds = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds
    # The signed thinking goes back in a later turn, as clients send it.
    again = client.messages.create(model=model, max_tokens=4, thinking=NO_THINKING,
                                   extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": "And now?"}])
    assert again.usage.output_tokens == 4


def test_count_tokens_equals_what_the_message_reads(client, qwen):
    _, model = qwen
    body = {"model": model, "system": "You are a weather bot.", "tools": [WEATHER],
            "thinking": NO_THINKING,
            "messages": [{"role": "user", "content": "How warm is Rome today, exactly?"}]}
    counted = client.messages.count_tokens(**body)
    msg = client.messages.create(**body, max_tokens=2)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert counted.input_tokens > 20


def test_bad_requests_are_anthropic_errors_never_500s(client, qwen):
    srv, model = qwen
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=5, extra_body={"temperature": 3},
                               messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonexistent", max_tokens=5,
                               messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as e:  # the context is 4096 tokens
        client.messages.create(model=model, max_tokens=5,
                               messages=[{"role": "user", "content": "word " * 5000}])
    validate(e.value.body, "ErrorResponse")  # in Anthropic's words, which Claude Code reads
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 4096 maximum",  # to compact
                        e.value.body["error"]["message"])
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for bad in ({"model": model}, {"model": model, "max_tokens": 3, "messages": "hi"},
                    {"model": model, "max_tokens": 3, "messages": [{"role": "user",
                                                                     "content": [{"type": 7}]}]}):
            r = http.post("/v1/messages", json=bad)
            assert r.status_code == 400, r.text
            validate(r.json(), "ErrorResponse")


def test_max_tokens_is_a_ceiling_as_claude_code_sends_it(client, qwen):
    """Claude Code asks for 32000 tokens on every turn: a model with less context left
    generates what is left (here up to a stop sequence) instead of refusing."""
    _, model = qwen
    body = {"model": model, "thinking": NO_THINKING, "extra_body": {"temperature": 0},
            "messages": [{"role": "system", "content": "A reminder mid-conversation."},
                         {"role": "user", "content": "Go on."}]}
    text = client.messages.create(**body, max_tokens=10).content[0].text
    # (streamed, as the SDK requires for a max_tokens this large)
    with client.messages.stream(**body, max_tokens=32000, stop_sequences=[text[4:7]]) as s:
        msg = s.get_final_message()
    assert msg.stop_reason == "stop_sequence" and msg.content[0].text == text[:text.find(text[4:7])]


# What Claude Code 2.1.332 sends (logged through a proxy): these betas, adaptive thinking
# with display omitted, output_config.effort, context_management, deferred tools.
CLAUDE_CODE_BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14",
                     "context-management-2025-06-27", "mid-conversation-tool-changes-2026-07-01",
                     "thinking-token-count-2026-05-13", "advanced-tool-use-2025-11-20",
                     "effort-2025-11-24"]


def test_models_list_gives_each_models_window(client, qwen):
    _, model = qwen
    [info] = [m for m in client.models.list() if m.id == model]
    assert info.type == "model" and info.max_input_tokens == 4096 == info.max_tokens
    assert client.models.retrieve(model).max_input_tokens == 4096


def test_claude_codes_betas_and_context_management_pass(client, qwen):
    """Old tool results cleared (the worker's token counts), the last kept, an edit this
    server does not do named in X-MLXD-Warning rather than refused."""
    _, model = qwen
    messages = [{"role": "user", "content": "Weather?"}]
    for i in range(3):
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}",
                                               "name": "get_weather",
                                               "input": {"city": "Paris", "days": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                          "content": "sunny and warm " * 40}]}]
    edits = [{"type": "clear_thinking_20251015", "keep": "all"},
             {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                              "value": 100},
              "keep": {"type": "tool_uses", "value": 1}},
             {"type": "compact_20260112"}]
    raw = client.beta.messages.with_raw_response.create(
        model=model, max_tokens=8, messages=messages, betas=CLAUDE_CODE_BETAS,
        tools=[{**WEATHER, "defer_loading": False}], context_management={"edits": edits},
        thinking={"type": "adaptive", "display": "omitted"},
        extra_body={"output_config": {"effort": "high"}, "temperature": 0})
    assert "compact_20260112" in raw.headers["x-mlxd-warning"]
    msg = raw.parse()
    [applied] = msg.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 2
    counted = client.messages.count_tokens(model=model, messages=messages, tools=[WEATHER])
    assert 0 < applied.cleared_input_tokens < counted.input_tokens
    # the edited prompt is what generation read: counted less what was cleared
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) \
        == counted.input_tokens - applied.cleared_input_tokens



def test_a_tool_call_cut_off_by_max_tokens_is_its_last_block(client, qwen):
    """As Anthropic does: the call the output ran out of tokens inside stays, the last
    block, with the input written so far (the SDK's partial reading of it, streamed or
    not), and stop_reason max_tokens. It was dropped (content [])."""
    srv, model = qwen
    body = dict(model=model, thinking=NO_THINKING, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather",
                             "disable_parallel_tool_use": True},
                extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}])
    whole = client.messages.create(max_tokens=200, **body)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and set(use.input) == {"city", "days"}
    cut = client.messages.create(max_tokens=whole.usage.output_tokens - 4, **body)
    validate(cut.model_dump(exclude_unset=True, exclude_none=True), "Message")
    assert cut.stop_reason == "max_tokens" and cut.content[-1].type == "tool_use"
    last = cut.content[-1]
    assert last.name == "get_weather" and last.id
    # What it holds is what the whole call holds, so far (greedy: the same start).
    assert all(use.input[k] == v for k, v in last.input.items())
    with client.messages.stream(max_tokens=whole.usage.output_tokens - 4, **body) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert final.content[-1].model_dump() == last.model_dump() | {"id": final.content[-1].id}

    def streamed_json(max_tokens):
        raw = {k: v for k, v in body.items() if k != "extra_body"}
        return "".join(d["delta"]["partial_json"] for n, d in raw_events(srv, {
            **raw, "temperature": 0, "max_tokens": max_tokens})
            if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")

    # Streamed, the input is the model's JSON so far: a strict start of the whole call's.
    written, full = streamed_json(whole.usage.output_tokens - 4), streamed_json(200)
    assert written and full.startswith(written) and written != full


def test_an_answer_the_window_cut_short_says_so(client, qwen):
    """max_tokens is a ceiling (Claude Code's 32000): an answer that stops because the
    prompt and it filled the model's window is `model_context_window_exceeded`, as
    Anthropic reports it (a client then compacts, not asks for more tokens); one that
    stops at the client's own max_tokens stays `max_tokens`."""
    _, model = qwen
    window = client.models.retrieve(model).max_input_tokens
    per_word = client.messages.count_tokens(model=model, messages=[
        {"role": "user", "content": "ab " * 1000}]).input_tokens / 1000
    words = int((window - 40) / per_word)
    body = {"model": model, "thinking": NO_THINKING, "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "ab " * words}]}
    prompt = client.messages.count_tokens(model=model, messages=body["messages"]).input_tokens
    assert window - 60 < prompt < window - 4
    with client.messages.stream(**body, max_tokens=32000) as s:
        full = s.get_final_message()
    assert full.stop_reason == "model_context_window_exceeded"
    assert full.usage.input_tokens + full.usage.cache_read_input_tokens \
        + full.usage.output_tokens == window
    short = client.messages.create(**body, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
