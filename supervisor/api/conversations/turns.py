"""A response's turn in a conversation (`conversation` on POST /v1/responses).

Before it runs: the conversation's items, oldest first, come before the request's input
(an unknown conversation is a 404, an input item reusing an id the conversation holds a
400). When it ends `completed` or `incomplete`, its input items and then its output items
are appended (api/responses/runs.py calls the appender before it reports the end, so the
next request on the conversation sees them); a failed or cancelled response adds nothing.
"""

from __future__ import annotations

import logging

from supervisor.api.conversations.shapes import not_found
from supervisor.api.conversations.store import ConversationStore
from supervisor.api.responses.items import output_to_items
from supervisor.api.responses.store import ResponseStore, StoreUnavailable
from supervisor.http.errors import APIError

log = logging.getLogger("mlxd.conversations")

# The ends of a response whose items join the conversation.
APPENDED = ("completed", "incomplete")


async def prefix(store: ResponseStore, cid: str, input_items: list) -> list:
    """The conversation's items, then `input_items`."""
    items = await ConversationStore(store).items(cid)
    if items is None:
        raise not_found(cid, "conversation")
    held = {i["id"] for i in items}
    for i, item in enumerate(input_items):
        if item["id"] in held:
            raise APIError.bad_request(f"Duplicate item found with id '{item['id']}': the "
                                       "conversation already holds it.", f"input[{i}].id",
                                       "duplicate_item")
    return items + list(input_items)


def appender(store: ResponseStore, cid: str):
    """The runs.py hook: (status, input items, output items) → the conversation."""
    conversations = ConversationStore(store)

    async def append(status: str, input_items: list, output: list) -> None:
        if status not in APPENDED:
            return
        try:
            await conversations.append(cid, list(input_items) + output_to_items(output))
        except StoreUnavailable:
            raise  # the run retries it with its final write
        except Exception:  # a bug: the response's own final write must still happen
            log.exception("conversation %s: could not add a response's items", cid)
    return append
