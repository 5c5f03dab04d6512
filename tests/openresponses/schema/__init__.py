"""Validate JSON against the Open Responses specification's shapes (openresponses.schema.json).

    validate(response, "ResponseResource")     # raises jsonschema.ValidationError
    validate(event, "StreamingEvent")
    check_response(response); check_event(event)  # this schema AND OpenAI's

OpenAI's schema (tests/schema.py) and this one disagree in places, and a client may hold a
server to either: `usage` is required here and may be null, OpenAI's may be absent but
never null; presence_penalty, frequency_penalty, top_logprobs, service_tier,
max_tool_calls and safety_identifier are required here; a FunctionTool's `description`
is required (nullable). So every Responses object the tests build is checked against both.

openresponses.schema.json is written for these tests (README.md says from what), in
JSON Schema 2020-12: the required fields, types and enums of ResponseResource, its items
and every streaming event, without the specification's descriptions and examples.
Unknown properties are allowed, as the specification's own validators allow them.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from tests import schema as openai_schema

SCHEMA_PATH = Path(__file__).resolve().parent / "openresponses.schema.json"


@functools.cache
def _document() -> dict:
    doc = json.loads(SCHEMA_PATH.read_text())
    Draft202012Validator.check_schema(doc)
    return doc


@functools.cache
def validator(name: str) -> Draft202012Validator:
    doc = _document()
    if name not in doc["$defs"]:
        raise KeyError(f"no definition {name!r} in {SCHEMA_PATH.name}")
    return Draft202012Validator({**doc, "$ref": f"#/$defs/{name}"})


def validate(instance, name: str) -> None:
    """Raise the most relevant ValidationError if `instance` is not a valid `name`."""
    error = best_match(validator(name).iter_errors(instance))
    if error is not None:
        raise error


def check_response(response: dict) -> None:
    """A Response object, valid under both schemas."""
    openai_schema.validate(_openai_view(response), "Response")
    validate(response, "ResponseResource")


def check_event(event: dict) -> None:
    """A Responses streaming event, valid under both schemas."""
    openai_schema.validate(_openai_view(event), "ResponseStreamEvent")
    validate(event, "StreamingEvent")


def _openai_view(obj: dict) -> dict:
    """OpenAI's schema types a response's `usage` as an object, never null, though its
    own examples (response.created, a cancelled response) carry `"usage": null`, as the
    API does: a null usage is left out for that check."""
    if obj.get("usage", 1) is not None and (obj.get("response") or {}).get("usage", 1) \
            is not None:
        return obj
    obj = copy.deepcopy(obj)
    for r in (obj, obj.get("response")):
        if isinstance(r, dict) and "usage" in r and r["usage"] is None:
            del r["usage"]
    return obj
