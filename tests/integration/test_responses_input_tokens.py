"""POST /v1/responses/input_tokens with the official client
(`client.responses.input_tokens.count`) on a real server: the count is the prompt the
same request gets as a response (its `usage.input_tokens`), with instructions and tools
rendered by the template, and with a stored chain before `previous_response_id`; nothing
is generated or stored. Shapes checked against OpenAI's spec (TokenCountsResource)."""

from __future__ import annotations

import openai
import pytest

from tests.integration.test_responses_tools import NO_THINKING, WEATHER
from tests.schema import validate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def qwen(qwen_server, family_model):
    return qwen_server, str(family_model("qwen"))


@pytest.fixture
def oai(qwen) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen[0].url + "/v1", api_key="unused", max_retries=0)


def test_the_count_is_the_prompt_a_response_gets(oai, qwen):
    srv, model = qwen
    ask = {"model": model, "input": "Weather in Paris for 3 days?", "instructions": "Be brief.",
           "tools": [WEATHER], "reasoning": NO_THINKING}
    counted = oai.responses.input_tokens.count(**ask)
    validate(counted.model_dump(), "TokenCountsResource", strict=True)
    first = oai.responses.create(**ask, max_output_tokens=4)
    assert counted.input_tokens == first.usage.input_tokens
    bare = oai.responses.input_tokens.count(model=model, input="Weather in Paris for 3 days?")
    assert 0 < bare.input_tokens < counted.input_tokens   # the tools and instructions count
    # After a stored response, its chain counts too.
    then = {"model": model, "previous_response_id": first.id, "input": "And in Rome?",
            "tools": [WEATHER], "reasoning": NO_THINKING}
    chained = oai.responses.input_tokens.count(**then)
    follow = oai.responses.create(**then, max_output_tokens=4)
    assert chained.input_tokens == follow.usage.input_tokens > counted.input_tokens
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_tokens.count(model=model, previous_response_id="resp_gone",
                                         input="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.input_tokens.count(model=model, input=[{"type": "nonsense"}])
    assert e.value.body["param"].startswith("input")
