"""Validate JSON against Anthropic's Messages API shapes, vendored in shapes.json.

    validate(body, "Message")                # raises jsonschema.ValidationError
    validate(event, "RawContentBlockDeltaEvent")
    validate_event(name, data)               # a stream event by its SSE event name

shapes.json was generated from the anthropic SDK (see SOURCE.md) with:

    import json, anthropic.types as t
    def strict(n):
        if isinstance(n, dict):
            if n.get("type") == "object" and "properties" in n:
                n["additionalProperties"] = False
            for v in n.values(): strict(v)
        elif isinstance(n, list):
            for v in n: strict(v)
    out = {}
    for name in ["Message", "MessageTokensCount", "ErrorResponse", "RawMessageStartEvent",
                 "RawMessageDeltaEvent", "RawMessageStopEvent", "RawContentBlockStartEvent",
                 "RawContentBlockDeltaEvent", "RawContentBlockStopEvent"]:
        s = getattr(t, name).model_json_schema(); strict(s); out[name] = s
    out["PingEvent"] = {"type": "object", "properties": {"type": {"const": "ping"}},
                        "required": ["type"], "additionalProperties": False}
    json.dump(out, open("shapes.json", "w"), indent=1, sort_keys=True)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jsonschema import Draft202012Validator

SHAPES = Path(__file__).resolve().parent / "shapes.json"
EVENTS = {"message_start": "RawMessageStartEvent", "message_delta": "RawMessageDeltaEvent",
          "message_stop": "RawMessageStopEvent", "content_block_start": "RawContentBlockStartEvent",
          "content_block_delta": "RawContentBlockDeltaEvent",
          "content_block_stop": "RawContentBlockStopEvent", "ping": "PingEvent",
          "error": "ErrorResponse"}


@functools.lru_cache(maxsize=None)
def _validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(SHAPES.read_text())[name])


def validate(instance, name: str) -> None:
    _validator(name).validate(instance)


def validate_event(event: str, data: dict) -> None:
    """A stream event: its name must be Anthropic's, its data that event's shape and its
    `type` the event's name."""
    assert event in EVENTS, f"not an Anthropic stream event: {event!r}"
    assert data.get("type") == event, (event, data)
    validate(data, EVENTS[event])
