"""GET /v1/models in Anthropic's shape, for the clients of the Messages API.

Anthropic's Models API (`anthropic` SDK `models.list()`/`retrieve()`, Claude Code's
gateway discovery) is the same path as OpenAI's, told apart by the `anthropic-version`
header every Anthropic client sends. Its objects carry what such a client can act on: the
model's real window as `max_input_tokens` and the most a `max_tokens` may ask for (the
same number: Messages takes `max_tokens` as a ceiling on what the window leaves), so a
client that sizes its compaction from the Models API compacts before mlxd refuses the
prompt. Only models that serve Messages are listed (an embedding or speech model is no
answer to "which model can I message"); mlxd's own fields (`state`, `kind`,
`context_length`) ride along. The list pages as Anthropic's does: `limit` (1..1000,
default 20), `after_id` / `before_id`, `has_more`, `first_id`, `last_id`.
"""

from __future__ import annotations

from datetime import datetime, timezone

from aiohttp import web

from supervisor.api.fields.params import invalid_value
from supervisor.http.errors import INVALID_REQUEST, APIError

HEADER = "anthropic-version"
DEFAULT_LIMIT, MAX_LIMIT = 20, 1000


def wanted(request: web.Request) -> bool:
    """Whether the caller speaks Anthropic's API (its clients always send the header)."""
    return HEADER in request.headers


def model_info(entry: dict) -> dict | None:
    """An OpenAI-shaped /v1/models entry (api/models.py) as Anthropic's ModelInfo, or None
    for a model that does not serve Messages."""
    if "messages" not in entry.get("capabilities", ()):
        return None
    window = entry.get("context_length")
    created = datetime.fromtimestamp(entry.get("created") or 0, timezone.utc)
    return {"type": "model", "id": entry["id"], "display_name": entry["id"],
            "created_at": created.isoformat().replace("+00:00", "Z"), "lifecycle": "active",
            "max_input_tokens": window, "max_tokens": window,
            "state": entry.get("state"), "kind": entry.get("kind"), "context_length": window}


def one(entry: dict) -> dict:
    info = model_info(entry)
    if info is None:  # Anthropic's word for it: no such model (for Messages)
        raise APIError(404, f"The model `{entry['id'][:256]}` does not serve the Messages "
                       f"API (it is a {entry.get('kind')} model).", INVALID_REQUEST, "model",
                       "model_not_found")
    return info


def page(entries: list[dict], query) -> dict:
    infos = [i for i in map(model_info, entries) if i is not None]
    limit = _limit(query.get("limit"))
    ids = [i["id"] for i in infos]
    if query.get("after_id") in ids:
        infos = infos[ids.index(query["after_id"]) + 1:]
        data, more = infos[:limit], len(infos) > limit
    elif query.get("before_id") in ids:
        infos = infos[:ids.index(query["before_id"])]
        data, more = infos[-limit:], len(infos) > limit
    else:
        data, more = infos[:limit], len(infos) > limit
    return {"data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
        raise invalid_value("limit", f"{value[:20]!r}: expected an integer from 1 to "
                            f"{MAX_LIMIT}.")
    return int(value)
