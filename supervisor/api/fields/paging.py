"""OpenAI's cursor lists (`limit`, `order`, `after` in the query; `data`, `first_id`,
`last_id`, `has_more` in the body), as a response's input items and a conversation's
items are paged: one rule, so both lists page alike."""

from __future__ import annotations

from typing import Mapping

from supervisor.api.fields.params import invalid_value, opt_int


def page(items: list[dict], query: Mapping[str, str], noun: str) -> dict:
    """One page of `items` (oldest first, each with an `id`): `limit` 1-100 (20), `order`
    asc or desc (the default, newest first), `after` the id the page starts after (a 400
    naming the `noun` when no item has it)."""
    raw = query.get("limit")
    limit = opt_int({"limit": int(raw) if (raw or "").isdigit() else raw}, "limit", 1, 100) or 20
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_value("order", "expected 'asc' or 'desc'.")
    items = list(items if order == "asc" else reversed(items))
    after = query.get("after")
    if after:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise invalid_value("after", f"No {noun} with id '{after}'.")
        items = items[ids.index(after) + 1:]
    data = items[:limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(items) > limit}
