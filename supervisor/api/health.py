"""GET /health (the model routes are in supervisor/api/models.py)."""

from __future__ import annotations

from aiohttp import web

from supervisor.api.responses.routes import RESPONSES
from supervisor.keys import POOL


async def health(request: web.Request) -> web.Response:
    """Answered from cached state: never waits on a worker (nor on the store's disk).
    A store that is down leaves the HTTP status as it is (generation still serves) but
    makes an `ok` server `degraded`, with the reason: stored responses answer 503."""
    status, body = request.app[POOL].health()
    svc = request.app.get(RESPONSES)
    if svc is not None:
        body["store"] = "ok" if svc.store.available else "unavailable"
        if not svc.store.available and body["status"] == "ok":
            body["status"] = "degraded"
            body["reason"] = ("the response store is unavailable: stored responses "
                              "answer 503")
    return web.json_response(body, status=status)
