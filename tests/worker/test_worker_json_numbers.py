"""The JSON grammars mlxd compiles admit only numbers that stay finite as doubles (issue 30,
item 3: a forced call streamed `"duration_hours": Infinity` after the model wrote 1e999).
Checked on the compiled grammar itself, one byte per token, so every spelling is tried
exactly: `1e999` is refused where `1e308` and `-2.5E-10` are taken, in every place a
number can sit (a number field, an integer, any value of json_object, arrays, anyOf,
$ref), while what the schema bounds stays llguidance's."""

from __future__ import annotations

import json

import llguidance
import pytest

from worker.text.json_grammar import definitions, json_rule


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes (and an EOS)."""
    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def accepts(schema, text: str) -> bool:
    start = f"start: {json_rule(schema)}\n"
    matcher = llguidance.LLMatcher(TOKENIZER, llguidance.LLMatcher.grammar_from_lark(
        start + definitions(start)), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = list(text.encode())
    return matcher.validate_tokens(ids) == len(ids) and (
        matcher.consume_tokens(ids) and matcher.is_accepting())


FINITE = ["0", "-0", "1.5", "12345", "1e308", "-2.5E-10", "1.6e+308", "9.99e307", "1e-999",
          "1" + "0" * 307]
NOT_FINITE = ["1e999", "-1E400", "2e308", "1.8e308", "1" + "0" * 308, "Infinity", "NaN"]

OBJECT = {"type": "object", "properties": {"d": {"type": "number"}, "s": {"type": "string"}},
          "required": ["d"], "additionalProperties": False}
WHERE = {  # a schema, and where a number goes in its JSON
    "number": ({"type": "number"}, "{}"),
    "property": (OBJECT, '{{"d": {}, "s": "x"}}'),
    "json_object value": ({"type": "object"}, '{{"a": [true, {{"b": {}}}]}}'),
    "array item": ({"type": "array", "items": {"type": "number"}, "minItems": 1}, "[1, {}]"),
    "anyOf": ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "{}"),
    "$ref": ({"type": "object", "properties": {"p": {"$ref": "#/$defs/n"}},
              "required": ["p"], "additionalProperties": False,
              "$defs": {"n": {"type": ["number", "null"]}}}, '{{"p": {}}}'),
    "untyped": ({"description": "anything"}, "{}"),
}


@pytest.mark.parametrize("where", sorted(WHERE))
def test_only_finite_numbers_are_admitted(where):
    schema, shape = WHERE[where]
    for number in FINITE:
        assert accepts(schema, shape.format(number)), number
    for number in NOT_FINITE:
        assert not accepts(schema, shape.format(number)), number


def test_integers_are_bounded_too():
    assert accepts({"type": "integer"}, "9" * 308)
    assert not accepts({"type": "integer"}, "9" * 309)
    assert not accepts({"type": "integer"}, "1.5") and not accepts({"type": "integer"}, "1e3")


def test_what_the_schema_says_still_holds():
    assert not accepts(OBJECT, '{"s": "x"}')                  # required
    assert not accepts(OBJECT, '{"d": 1, "x": 2}')            # closed
    assert not accepts(OBJECT, '{"d":1}')                     # the server's separators
    bounded = {"type": "integer", "minimum": 1, "maximum": 7}  # llguidance's own range
    assert accepts(bounded, "7") and not accepts(bounded, "8")
    half = {"type": "number", "minimum": 0}                   # given a finite upper bound
    assert accepts(half, "2.5") and not accepts(half, "-1") and not accepts(half, "1e999")
    items = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}
    assert [accepts(items, json.dumps(list(range(n)))) for n in range(5)] == [
        False, False, True, True, False]
    assert accepts({"type": "string"}, '"1e999"')              # a string is only text
    # Keywords the translation does not follow leave the schema to llguidance whole.
    assert accepts({"allOf": [{"type": "integer"}]}, "3")
    assert accepts({"type": "integer", "minimum": 10 ** 17}, "1" + "0" * 18)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": [], "required": "x"}, {"type": "array", "minItems": "a"},
    {"$defs": [], "anyOf": 3}, {"type": "number", "maximum": "big"}])
def test_a_malformed_schema_is_left_to_llguidance_to_refuse(schema):
    assert json_rule(schema).startswith("%json ")  # compiled there: a 400, not a crash
