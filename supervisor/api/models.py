"""GET /v1/models, GET /v1/models/{id}, GET /health."""

from __future__ import annotations

from aiohttp import web

from supervisor.api import shapes
from supervisor.keys import POOL


def _model(pool, runner) -> dict:
    return shapes.model_object(
        runner.id, pool.created.get(runner.id, 0), "mlxd",
        state=runner.state, context_length=runner.context_length,
        random_weights=runner.random_weights)


async def list_models(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    return web.json_response(shapes.model_list([_model(pool, r) for r in pool.runners.values()]))


async def get_model(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    return web.json_response(_model(pool, pool.get(request.match_info["model"])))


async def health(request: web.Request) -> web.Response:
    status, body = request.app[POOL].health()
    return web.json_response(body, status=status)
