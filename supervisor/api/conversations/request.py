"""Conversations API bodies (CreateConversationBody, UpdateConversationBody, the items
body) and the `conversation` field of POST /v1/responses (ConversationParam).

Items are the Responses API's input items, normalised by the same parser
(api/responses/items.py), so a conversation replays exactly as an input would. Unknown
fields are ignored; wrong types are 400s naming the field.
"""

from __future__ import annotations

from typing import Optional

from supervisor.api.fields.limits import check_length
from supervisor.api.fields.params import (invalid_type, missing, opt_list, parse_metadata,
                                          unsupported)
from supervisor.api.responses.items import normalize_input

MAX_ADDED = 20  # items one request may add (the spec's maxItems)


def conversation_id(body: dict) -> Optional[str]:
    """`conversation` on POST /v1/responses: an id, or an object with an `id`. Together
    with `previous_response_id` it is a 400, as OpenAI answers: the two say where the
    conversation lives, and they would disagree."""
    value = body.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict):
        if not isinstance(value.get("id"), str):
            raise invalid_type("conversation.id", "a string", value.get("id"))
        value = value["id"]
    elif not isinstance(value, str):
        raise invalid_type("conversation", "a string or an object", value)
    if body.get("previous_response_id") is not None:
        raise unsupported("conversation", "Mutually exclusive parameters: Ensure you are only "
                          "providing one of: 'previous_response_id' or 'conversation'.",
                          "mutually_exclusive_parameters")
    return value


def parse_items(body: dict, required: bool) -> list[dict]:
    """`items`: up to MAX_ADDED input items, normalised (each gets an id)."""
    items = opt_list(body, "items")
    if items is None:
        if required:
            raise missing("items")
        return []
    check_length("items", items, MAX_ADDED)
    return normalize_input(items, "items")


def parse_create(body: dict) -> tuple[dict, list[dict]]:
    """POST /v1/conversations: (metadata, items)."""
    return parse_metadata(body) or {}, parse_items(body, required=False)


def parse_update(body: dict) -> dict:
    """POST /v1/conversations/{id}: the metadata that replaces the old."""
    if body.get("metadata") is None:
        raise missing("metadata")
    return parse_metadata(body)
