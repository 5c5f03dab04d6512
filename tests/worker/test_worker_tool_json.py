"""Tool calls are strict JSON that validates (issue 30, item 3), in the real engine on tiny
random-weight models: with tool_choice "auto" too, a call the model opens is held to the
tools' schemas in the family's own format (worker/text/constraints.py), so its arguments parse
and validate; the random model is steered into opening one with logit_bias on the
family's call marker."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.worker.test_worker_generation_features import (  # noqa: F401 (a fixture)
    PARAMS, TOOLS, chat, family_engine, run)


@pytest.mark.parametrize("family", ["qwen", "qwen3_coder", "llama3", "mistral", "pythonic",
                                    "gemma"])
def test_a_call_the_model_opens_under_auto_validates(family_engine, family):
    engine = family_engine(family)
    opener = engine.tool_format.start or "{"  # Llama 3: an answer that opens with "{"
    ids = engine.tokenizer.encode(opener, add_special_tokens=False)
    assert len(ids) == 1
    calls_made = 0
    for seed in (1, 2, 3):
        text, _, calls, finish, tokens, _ = run(engine, chat(
            tools=TOOLS, tool_choice="auto", parallel_tool_calls=False, seed=seed,
            temperature=1.0, max_tokens=120, logit_bias=[[ids[0], 30.0]]))
        assert ids[0] in tokens, (family, seed)
        assert len(calls) == 1, (family, seed, text)
        jsonschema.validate(json.loads(calls[0].arguments), PARAMS[calls[0].name])
        assert opener not in text
        calls_made += 1
    assert calls_made == 3
