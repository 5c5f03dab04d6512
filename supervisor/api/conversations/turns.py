"""A response's turn in a conversation (`conversation` on POST /v1/responses).

Before it runs: the conversation's items, oldest first, come before the request's input
(an unknown conversation is a 404, an input item reusing an id the conversation holds a
400). When it ends `completed` or `incomplete`, its input items and then its output items
are appended (api/responses/runs.py calls the appender before it reports the end, so the
next request on the conversation sees them); a failed or cancelled response adds nothing.

The KV cache: a stored response keeps its final state under its id (a named snapshot,
worker/kvcache/snapshots.py), and the conversation remembers its latest such response, so
the next turn resumes from that state as a `previous_response_id` turn does (the worker
checks that the state's tokens begin the new prompt: items added or deleted since make
it fall back to prefix matching, never to a wrong state).
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


async def resume_point(store: ResponseStore, cid: str) -> str | None:
    """The snapshot the conversation's next turn resumes from: its latest stored
    response's id (None: none, or no such conversation, which `prefix` refuses)."""
    conv = await ConversationStore(store).get(cid)
    return None if conv is None else conv.last_response


def appender(store: ResponseStore, cid: str):
    """The runs.py hook: (status, input items, output items, the response's id when it
    is stored) → the conversation."""
    conversations = ConversationStore(store)

    async def append(status: str, input_items: list, output: list,
                     response_id: str | None) -> None:
        if status not in APPENDED:
            return
        try:
            await conversations.append(cid, list(input_items) + output_to_items(output),
                                       response_id)
        except StoreUnavailable:
            raise  # the run retries it with its final write
        except Exception:  # a bug: the response's own final write must still happen
            log.exception("conversation %s: could not add a response's items", cid)
    return append
