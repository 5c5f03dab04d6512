"""GET /health (the model routes are in supervisor/listing.py)."""

from __future__ import annotations

from aiohttp import web

from supervisor.keys import POOL


async def health(request: web.Request) -> web.Response:
    """Answered from cached state: never waits on a worker."""
    status, body = request.app[POOL].health()
    return web.json_response(body, status=status)
