"""POST /v1/completions (legacy text completions): the body parsed (request.py), run
through the one request lifecycle (api/lifecycle.py) and rendered as text completion
objects (shapes.py)."""

from __future__ import annotations

from aiohttp import web

from supervisor.api import lifecycle
from supervisor.api.completions import shapes
from supervisor.api.completions.request import parse_completion_request
from supervisor.http.errors import read_json


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion_request(await read_json(request))
    return await lifecycle.run(request, parsed, lambda model, created: shapes.CompletionShapes(
        shapes.new_completion_id(), created, model, parsed.logprobs is not None))


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
