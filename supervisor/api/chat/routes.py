"""POST /v1/chat/completions: the body parsed (request.py), run through the one request
lifecycle (api/lifecycle.py) and rendered as chat completion objects (shapes.py)."""

from __future__ import annotations

from aiohttp import web

from supervisor.api import lifecycle
from supervisor.api.chat import shapes
from supervisor.api.chat.request import parse_chat_request
from supervisor.http.errors import read_json


async def chat_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_chat_request(await read_json(request))
    return await lifecycle.run(request, parsed, lambda model, created: shapes.ChatShapes(
        shapes.new_chat_id(), created, model, parsed.include_usage, parsed.logprobs))


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
