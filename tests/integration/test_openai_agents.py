"""OpenAI's Agents SDK (`openai-agents`) running its agent loop on a real server, over the
Responses API (HTTP and its WebSocket mode) and over chat completions: a turn that must call a tool (`tool_choice:
required`, grammar-built arguments), the tool run by the SDK, its result sent back, and
the model's answer after it; streamed and not; chained by `previous_response_id` and by a
Conversation; a structured `output_type`. The model is the tiny Qwen3-Coder-template one
that ends its replies after one token (tests/openresponses/model.py), so each answer
completes; the tool's arguments are bounded so that its call does."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)
from agents.models.openai_responses import OpenAIResponsesWSModel
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration
set_tracing_disabled(True)   # (it would post traces to OpenAI)


class Report(BaseModel):
    city: Annotated[str, Field(max_length=10)]
    warm: bool


@pytest.fixture
def setup(stopping_server):
    """(a model factory by API, the bodies sent, the tool's calls)."""
    sent: list[tuple[str, dict]] = []

    async def record(request):
        if request.method == "POST":
            sent.append((request.url.path, json.loads(request.content)))

    def models(api: str):
        client = AsyncOpenAI(base_url=stopping_server.url + "/v1", api_key="unused",
                             max_retries=0, http_client=httpx.AsyncClient(
                                 event_hooks={"request": [record]}, timeout=120))
        cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        return cls(model=stopping_server.model, openai_client=client), client

    return models, sent


def weather_agent(model, calls: list) -> Agent:
    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)],
                    days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city for some days."""
        calls.append({"city": city, "days": days})
        return json.dumps({"temp": 21})

    return Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                 model_settings=ModelSettings(tool_choice="required", temperature=0,
                                              max_tokens=200, parallel_tool_calls=False))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_an_agent_calls_its_tool_and_answers_after_it(setup, api, stream):
    models, sent = setup
    model, _ = models(api)
    calls: list = []
    agent = weather_agent(model, calls)

    names = []
    if stream:
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        names = [e.name async for e in result.stream_events() if e.type == "run_item_stream_event"]
    else:
        result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
    assert [type(i).__name__ for i in result.new_items] == [
        "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    [call] = calls
    assert 1 <= call["days"] <= 7 and len(call["city"]) <= 12
    if stream:
        assert names == ["tool_called", "tool_output", "message_output_created"]
    # The second request carried the call and its output (matched by call id) back; the
    # SDK then let the model answer in text (tool_choice reset), and that is the final
    # output.
    assert len(sent) == 2
    second = json.dumps(sent[1][1])
    call_id = result.new_items[0].raw_item.call_id
    assert second.count(call_id) == 2 and '{\\"temp\\": 21}' in second
    assert isinstance(result.final_output, str) and result.final_output


async def test_an_agent_chains_by_previous_response_id_and_by_a_conversation(setup):
    models, sent = setup
    model, client = models("responses")
    calls: list = []
    agent = weather_agent(model, calls)
    await Runner.run(agent, "Weather?", max_turns=4, auto_previous_response_id=True)
    first, second = (body for _, body in sent)
    assert "previous_response_id" not in first
    # Only what is new went with the id: the tool's output.
    assert second["previous_response_id"].startswith("resp_")
    assert [i["type"] for i in second["input"]] == ["function_call_output"]

    sent.clear()

    conv = await client.conversations.create()
    await Runner.run(agent, "Weather?", max_turns=4, conversation_id=conv.id)
    await Runner.run(agent, "And tomorrow?", max_turns=4, conversation_id=conv.id)
    items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
    assert all(body["conversation"] == conv.id for path, body in sent if path == "/v1/responses")
    kinds = [i.type for i in items]
    assert kinds == ["message", "function_call", "function_call_output", "message"] * 2
    assert len(calls) == 3


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_a_structured_output_type_comes_back_as_the_model(setup, api):
    models, sent = setup
    model, _ = models(api)
    agent = Agent(name="report", instructions="Report.", model=model, output_type=Report,
                  model_settings=ModelSettings(temperature=0, max_tokens=200))
    result = await Runner.run(agent, "Paris?", max_turns=2)
    assert isinstance(result.final_output, Report)
    assert len(result.final_output.city) <= 10
    asked = json.dumps(sent[-1][1])
    assert '"json_schema"' in asked and '"strict": true' in asked


async def test_an_agent_runs_over_the_responses_websocket(stopping_server):
    # The SDK's WebSocket transport (`response.create` frames on /v1/responses): one
    # connection for every turn of both runs.
    posted: list = []

    async def record(request):
        posted.append(request.url.path)

    client = AsyncOpenAI(base_url=stopping_server.url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
    model = OpenAIResponsesWSModel(model=stopping_server.model, openai_client=client)
    calls: list = []
    agent = weather_agent(model, calls)
    try:
        result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
        streamed = Runner.run_streamed(agent, "Weather in Rome?", max_turns=4)
        names = [e.name async for e in streamed.stream_events()
                 if e.type == "run_item_stream_event"]
    finally:
        await model.close()
    assert [type(i).__name__ for i in result.new_items] == [
        "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert names == ["tool_called", "tool_output", "message_output_created"]
    assert len(calls) == 2 and result.final_output and streamed.final_output
    assert posted == []   # no turn fell back to HTTP


@pytest.fixture(scope="module")
def narrow_server(stopping_server):
    """The stopping model again, served with a 512-token window."""
    from tests.serverproc import ServerProcess

    with ServerProcess([stopping_server.model], "--max-context-tokens", "512") as srv:
        srv.wait_healthy()
        srv.model = stopping_server.model
        yield srv


async def test_a_long_history_goes_on_with_truncation_auto(narrow_server):
    # ModelSettings(truncation="auto"): a history past the window is cut at its start by
    # the server (supervisor/api/responses/truncation.py) and the run answers; without
    # it the same run fails with the server's context_length_exceeded.
    import openai

    sent = []

    async def record(request):
        if request.method == "POST":
            sent.append(json.loads(request.content))

    client = AsyncOpenAI(base_url=narrow_server.url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.AsyncClient(event_hooks={"request": [record]},
                                                       timeout=120))
    history = []
    for t in range(8):
        history += [{"role": "user", "content": f"Note {t}: " + " ".join(
                        f"item{t}n{i}" for i in range(30))},
                    {"role": "assistant", "content": f"Noted {t}."}]
    history.append({"role": "user", "content": "What was the last note?"})

    def agent(**settings):
        model = OpenAIResponsesModel(model=narrow_server.model, openai_client=client)
        return Agent(name="notes", instructions="Answer briefly.", model=model,
                     model_settings=ModelSettings(max_tokens=8, temperature=0, **settings))

    with pytest.raises(openai.BadRequestError) as e:
        await Runner.run(agent(), history, max_turns=1)
    assert e.value.body["code"] == "context_length_exceeded"
    result = await Runner.run(agent(truncation="auto"), history, max_turns=1)
    assert result.final_output is not None
    assert sent[-1]["truncation"] == "auto"
    (response,) = result.raw_responses
    assert 0 < response.usage.input_tokens <= 512 - 8
