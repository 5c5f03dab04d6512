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


def _missing(request: web.Request) -> APIError:
    return shapes.not_found(request.match_info["id"], "conversation_id")


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
    conv = await _store(request).get(request.match_info["id"])
    if conv is None:
        raise _missing(request)
    return web.json_response(shapes.conversation(conv))


@needs_store
async def update(request: web.Request) -> web.Response:
    metadata = parse_update(await read_json(request))
    conv = await _store(request).set_metadata(request.match_info["id"], metadata)
    if conv is None:
        raise _missing(request)
    return web.json_response(shapes.conversation(conv))


@needs_store
async def delete(request: web.Request) -> web.Response:
    cid = request.match_info["id"]
    if not await _store(request).delete(cid):
        raise _missing(request)
    return web.json_response(shapes.deleted(cid))


@needs_store
async def list_items(request: web.Request) -> web.Response:
    items = await _store(request).items(request.match_info["id"])
    if items is None:
        raise _missing(request)
    return web.json_response(page(items, request.query, "item"))


@needs_store
async def add_items(request: web.Request) -> web.Response:
    items = parse_items(await read_json(request), required=True)
    try:
        added = await _store(request).add(request.match_info["id"], items)
    except (Duplicate, TooMany) as e:
        raise _refused(e) from None
    if not added:
        raise _missing(request)
    # All of them, in the order sent (at most MAX_ADDED, within one page's 100).
    return web.json_response(page(items, {"order": "asc", "limit": "100"}, "item"))


@needs_store
async def get_item(request: web.Request) -> web.Response:
    store, cid, item_id = _store(request), request.match_info["id"], request.match_info["item_id"]
    item = await store.item(cid, item_id)
    if item is None:
        if await store.get(cid) is None:
            raise _missing(request)
        raise shapes.item_not_found(item_id)
    return web.json_response(item)


@needs_store
async def delete_item(request: web.Request) -> web.Response:
    store, cid, item_id = _store(request), request.match_info["id"], request.match_info["item_id"]
    conv = await store.delete_item(cid, item_id)
    if conv is None:
        if await store.get(cid) is None:
            raise _missing(request)
        raise shapes.item_not_found(item_id)
    return web.json_response(shapes.conversation(conv))
