"""OpenAI's Predicted Outputs on chat completions, through the openai SDK, on the real
`demo` model (a trained model: its answer re-tokenizes as it was generated, so a
prediction of it is accepted). The worker drafts from the prediction
(worker/speculative/): the text is the model's own either way, and usage reports the
drafted tokens accepted and rejected."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.conftest import assert_envelope
from tests.schema import validate

pytestmark = pytest.mark.integration

CODE = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(model="demo", messages=CODE, temperature=0,
                                          max_tokens=40, **kw)


def test_a_prediction_changes_nothing_but_the_accepted_counts(client):
    plain = ask(client)
    answer = plain.choices[0].message.content
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)

    exact = ask(client, prediction={"type": "content", "content": answer})
    assert exact.choices[0].message.content == answer
    got = exact.usage.completion_tokens_details
    # Every token but those the model sampled itself at each verification came from the
    # prediction, and none of it was wrong.
    assert got.rejected_prediction_tokens == 0
    assert exact.usage.completion_tokens // 2 < got.accepted_prediction_tokens \
        < exact.usage.completion_tokens
    validate(exact.usage.model_dump(exclude_unset=True), "CompletionUsage", strict=True)

    edited = answer.replace("def ", "def my_", 1)  # a prediction that departs, as parts
    parts = [{"type": "text", "text": edited[:20]}, {"type": "text", "text": edited[20:]}]
    other = ask(client, prediction={"type": "content", "content": parts}, stream=True,
                stream_options={"include_usage": True})
    chunks = list(other)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    usage = chunks[-1].usage.completion_tokens_details
    assert usage.accepted_prediction_tokens > 0 and usage.rejected_prediction_tokens > 0


@pytest.mark.parametrize("prediction, param", [
    ({"type": "file", "content": "x"}, "prediction.type"),
    ({"content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content[0]"),
    ("x", "prediction"),
])
def test_a_bad_prediction_is_a_400_naming_it(real_server, prediction, param):
    r = httpx.post(real_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": CODE, "max_tokens": 1, "prediction": prediction})
    assert_envelope(r, 400, param=param)
