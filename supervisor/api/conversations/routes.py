"""The /v1/conversations routes: a conversation (create, retrieve, update its metadata,
delete) and its items (list, add, retrieve, delete), in OpenAI's shapes.

They live in the response store (store.py), so they share its outage rule: while it is
down they answer 503 `store_unavailable` with Retry-After (api/responses/routes.py).
"""

from __future__ import annotations

from aiohttp import web

from supervisor.api.conversations import shapes
from supervisor.api.conversations.request import parse_create, parse_items, parse_update
from supervisor.api.conversations.store import MAX_ITEMS, ConversationStore, Duplicate, TooMany
from supervisor.api.fields.paging import page
from supervisor.api.responses.routes import RESPONSES, needs_store
from supervisor.http.errors import APIError, read_json


def setup(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/conversations", create)
    r.add_get("/v1/conversations/{id}", retrieve)
    r.add_post("/v1/conversations/{id}", update)
    r.add_delete("/v1/conversations/{id}", delete)
    r.add_get("/v1/conversations/{id}/items", list_items)
    r.add_post("/v1/conversations/{id}/items", add_items)
    r.add_get("/v1/conversations/{id}/items/{item_id}", get_item)
    r.add_delete("/v1/conversations/{id}/items/{item_id}", delete_item)


def _store(request: web.Request) -> ConversationStore:
    return ConversationStore(request.app[RESPONSES].store)


async def _found(request: web.Request, value):
    """`value`, unless the store found nothing (None or False): then the 404 for what is
    missing, the conversation or else its item."""
    if value is not None and value is not False:
        return value
    cid, item_id = request.match_info["id"], request.match_info.get("item_id")
    if item_id is not None and await _store(request).get(cid) is not None:
        raise shapes.item_not_found(item_id)
    raise shapes.not_found(cid, "conversation_id")


def _refused(e: Duplicate | TooMany) -> APIError:
    if isinstance(e, Duplicate):
        return APIError.bad_request(f"Duplicate item found with id '{e.item_id}'.", "items",
                                    "duplicate_item")
    return APIError.bad_request(f"A conversation holds at most {MAX_ITEMS} items.", "items",
                                "array_above_max_length")


@needs_store
async def create(request: web.Request) -> web.Response:
    metadata, items = parse_create(await read_json(request))
    try:
        conv = await _store(request).create(metadata, items)
    except (Duplicate, TooMany) as e:
        raise _refused(e) from None
    return web.json_response(shapes.conversation(conv))


@needs_store
async def retrieve(request: web.Request) -> web.Response:
    conv = await _found(request, await _store(request).get(request.match_info["id"]))
    return web.json_response(shapes.conversation(conv))


@needs_store
async def update(request: web.Request) -> web.Response:
    metadata = parse_update(await read_json(request))
    conv = await _found(request, await _store(request).set_metadata(request.match_info["id"],
                                                                    metadata))
    return web.json_response(shapes.conversation(conv))


@needs_store
async def delete(request: web.Request) -> web.Response:
    cid = request.match_info["id"]
    await _found(request, await _store(request).delete(cid))
    return web.json_response(shapes.deleted(cid))


@needs_store
async def list_items(request: web.Request) -> web.Response:
    items = await _found(request, await _store(request).items(request.match_info["id"]))
    return web.json_response(page(items, request.query, "item"))


@needs_store
async def add_items(request: web.Request) -> web.Response:
    items = parse_items(await read_json(request), required=True)
    try:
        await _found(request, await _store(request).add(request.match_info["id"], items))
    except (Duplicate, TooMany) as e:
        raise _refused(e) from None
    # All of them, in the order sent (at most MAX_ADDED, within one page's 100).
    return web.json_response(page(items, {"order": "asc", "limit": "100"}, "item"))


@needs_store
async def get_item(request: web.Request) -> web.Response:
    m = request.match_info
    return web.json_response(await _found(request, await _store(request).item(m["id"],
                                                                               m["item_id"])))


@needs_store
async def delete_item(request: web.Request) -> web.Response:
    m = request.match_info
    conv = await _found(request, await _store(request).delete_item(m["id"], m["item_id"]))
    return web.json_response(shapes.conversation(conv))
