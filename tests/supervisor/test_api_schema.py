"""The spec validator itself (tests/schema.py): it must reject real mistakes, and must not
reject what the spec allows (its OpenAPI 3.0 leftovers translated correctly)."""

from __future__ import annotations

import copy

import pytest
from jsonschema import Draft202012Validator, ValidationError

from supervisor.api import lifecycle
from supervisor.api.chat import shapes
from tests.schema import _translate, errors, spec, validate

GOOD = shapes.chat_completion("chatcmpl-1", 1, "m", "hi", "stop", lifecycle.usage(1, 2))


def test_spec_is_vendored_and_3_1():
    doc = spec()
    assert doc["openapi"].startswith("3.1")
    assert "CreateChatCompletionResponse" in doc["components"]["schemas"]


def broken(mutate):
    obj = copy.deepcopy(GOOD)
    mutate(obj)
    return obj


@pytest.mark.parametrize("mutate", [
    lambda o: o.pop("created"),                                   # missing required
    lambda o: o["choices"][0].pop("logprobs"),                    # required-but-nullable
    lambda o: o["choices"][0]["message"].pop("refusal"),          # required-but-nullable
    lambda o: o["choices"][0].update(finish_reason="cancelled"),  # not in the enum
    lambda o: o["choices"][0].update(finish_reason=None),         # not nullable here
    lambda o: o.update(object="chat.completion.chunk"),           # wrong const
    lambda o: o.update(created="now"),                            # wrong type
    lambda o: o["usage"].pop("total_tokens"),                     # nested required
    lambda o: o["choices"][0]["message"].update(role="user"),     # nested enum
], ids=["created", "logprobs", "refusal", "enum", "null-finish", "object", "type", "usage",
        "role"])
def test_broken_objects_fail(mutate):
    with pytest.raises(ValidationError):
        validate(broken(mutate), "CreateChatCompletionResponse")


def test_strict_catches_unknown_keys():
    typo = broken(lambda o: o.update(system_fingerprnt="fp"))
    validate(typo, "CreateChatCompletionResponse")  # plain JSON Schema allows extras
    with pytest.raises(ValidationError, match="system_fingerprnt"):
        validate(typo, "CreateChatCompletionResponse", strict=True)
    nested = broken(lambda o: o["choices"][0].update(finsh_reason="stop"))
    with pytest.raises(ValidationError):
        validate(nested, "CreateChatCompletionResponse", strict=True)


def test_nullable_is_translated():
    # `usage: {$ref: CompletionUsage, nullable: true}` on chunks; nullable request fields.
    chunk = shapes.chat_chunk("chatcmpl-1", 1, "m", {"content": "x"}, include_usage=True)
    assert chunk["usage"] is None
    validate(chunk, "CreateChatCompletionStreamResponse", strict=True)
    validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
              "max_completion_tokens": None, "stream": None, "stop": None, "n": None,
              "seed": None, "logit_bias": None, "frequency_penalty": None},
             "CreateChatCompletionRequest", strict=True)
    validate({"model": "m", "prompt": None, "suffix": None, "max_tokens": None},
             "CreateCompletionRequest")
    # but a null where the spec has no nullable is still refused
    with pytest.raises(ValidationError):
        validate({"model": "m", "messages": None}, "CreateChatCompletionRequest")


def test_translate_units():
    nullable = Draft202012Validator(_translate({"type": "integer", "nullable": True}, False))
    assert nullable.is_valid(None) and nullable.is_valid(3) and not nullable.is_valid("3")
    ref_nullable = _translate({"$ref": "#/x", "nullable": True}, False)
    assert ref_nullable == {"anyOf": [{"$ref": "#/x"}, {"type": "null"}]}
    excl = Draft202012Validator(_translate(
        {"type": "number", "minimum": 0, "exclusiveMinimum": True}, False))
    assert not excl.is_valid(0) and excl.is_valid(0.5)
    incl = Draft202012Validator(_translate(
        {"type": "number", "minimum": 0, "exclusiveMinimum": False}, False))
    assert incl.is_valid(0)
    # data keys (examples, defaults, enums) are left alone
    data = {"enum": [{"nullable": True}], "default": {"nullable": True}}
    assert _translate(data, True) == data


def test_exclusive_minimum_in_the_spec():
    # learning_rate_multiplier: "auto" or a number > 0 (3.0 boolean exclusiveMinimum).
    hp = "FineTuneSupervisedHyperparameters"
    validate({"learning_rate_multiplier": 0.5}, hp)
    validate({"learning_rate_multiplier": 2}, hp)  # a bool bound would be `> 1`
    with pytest.raises(ValidationError):
        validate({"learning_rate_multiplier": 0}, hp)


def test_errors_lists_everything_and_unknown_component():
    bad = broken(lambda o: (o.pop("id"), o.update(object="x")))
    assert len(errors(bad, "CreateChatCompletionResponse")) == 2
    with pytest.raises(KeyError):
        validate({}, "NoSuchComponent")
