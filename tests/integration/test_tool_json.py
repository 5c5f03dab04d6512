"""Tool-call arguments are strict JSON that validates, end to end (issue 30, item 3): the
real supervisor and worker on the tiny Qwen-template model, steered with logit_bias.
Under tool_choice "auto" a call the model opens validates, whole and streamed; a forced number
field with the model pushed toward digits and exponents stays finite, where it used to
reach clients as `Infinity`, which strict parsers (Go's, JSON.parse into finite numbers)
refuse."""

from __future__ import annotations

import json

from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.integration.test_generation_features import (  # noqa: F401 (fixtures)
    MESSAGES, NO_THINKING, PARAMS, TOOLS, model, raw, stream)

HOURS = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"duration_hours": {"type": "number"}},
    "required": ["duration_hours"]}}}


def strict(text: str):
    """json.loads as a strict client reads: no NaN/Infinity, no number beyond a double."""
    def refuse(word):
        raise ValueError(word)

    def finite(word):
        value = float(word)
        assert value not in (float("inf"), float("-inf")), word
        return value
    return json.loads(text, parse_constant=refuse, parse_float=finite)


def ids_of(model: str, *texts: str) -> list[int]:
    """The first token of each text, by the model's own tokenizer."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    return [tokenizer.encode(t, add_special_tokens=False)[0] for t in texts]


def test_an_auto_call_the_model_opens_validates_whole_and_streamed(raw, model):
    marker = ids_of(model, "<tool_call>")[0]
    body = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": False, "temperature": 1.0, "max_tokens": 120,
            "logit_bias": {str(marker): 30}, **NO_THINKING}
    for seed in (1, 2):
        r = raw.post("/v1/chat/completions", json={**body, "seed": seed})
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1, r.json()
        jsonschema.validate(strict(calls[0]["function"]["arguments"]),
                            PARAMS[calls[0]["function"]["name"]])
        events = stream(raw, {**body, "seed": seed})
        args = "".join(tc["function"].get("arguments") or "" for e in events
                       for c in e["choices"] for tc in c["delta"].get("tool_calls") or ())
        assert args == calls[0]["function"]["arguments"]  # the same text, not re-written


def test_a_forced_number_pushed_toward_huge_exponents_stays_finite(raw, model):
    bias = {str(i): 8 for i in ids_of(model, "9", "e", "E", "+")}
    for seed in (1, 2, 3):
        r = raw.post("/v1/chat/completions", json={
            "model": model, "messages": MESSAGES, "tools": [HOURS], "seed": seed,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0,
            "max_tokens": 120, "logit_bias": bias, **NO_THINKING})
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        jsonschema.validate(strict(call["arguments"]), HOURS["function"]["parameters"])


@pytest.mark.integration
def test_the_real_model_pushed_toward_huge_exponents_writes_finite_json(real_server,
                                                                        real_model_dir):
    """SmolLM2 (`demo`) has no tool-call format: its JSON schema replies share the grammar."""
    schema = {"type": "object", "properties": {"hours": {"type": "number"}},
              "required": ["hours"]}
    # Greedy, this makes it write 9E+99, where the grammar before wrote 9E+9999… on.
    bias = {str(i): 12 for i in ids_of(str(real_model_dir), "e", "E", "+")}
    bias[str(ids_of(str(real_model_dir), "9")[0])] = 4
    r = httpx.post(real_server.url + "/v1/chat/completions", timeout=300, json={
        "model": "demo", "temperature": 0, "max_tokens": 30, "logit_bias": bias,
        "messages": [{"role": "user", "content": "How many hours is a light year of walking?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(strict(choice["message"]["content"]), schema)
