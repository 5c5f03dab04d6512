"""The aiohttp application factory."""

from __future__ import annotations

import logging

import zmq.asyncio
from aiohttp import web

from protocol.sockets import make_runtime_dir, remove_runtime_dir
from supervisor.api.chat import chat_completions
from supervisor.api.completions import completions
from supervisor.api.models import get_model, health, list_models
from supervisor.api.responses import routes as responses
from supervisor.config import Config
from supervisor.errors import install
from supervisor.keys import CONFIG, POOL
from supervisor.pool import Pool, process_link_factory

log = logging.getLogger("mlxd")


def create_app(config: Config, *, factory_for=None) -> web.Application:
    """`factory_for(model) -> LinkFactory` replaces real worker processes (tests)."""
    app = web.Application(client_max_size=config.max_body_bytes)
    install(app)
    app[CONFIG] = config
    app.cleanup_ctx.append(_workers(factory_for))
    app.on_shutdown.append(_cancel_requests)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/health", health)
    responses.setup(app)
    return app


async def _cancel_requests(app: web.Application) -> None:
    """Shutdown: before aiohttp waits for handlers, end every request (queued ones at
    once, running ones through a cancel), so no stream holds the exit up."""
    app[POOL].begin_shutdown()


def _workers(factory_for):
    async def ctx(app: web.Application):
        config = app[CONFIG]
        zctx = runtime_dir = None
        if factory_for is None:
            runtime_dir = make_runtime_dir()
            zctx = zmq.asyncio.Context()
            make = lambda model: process_link_factory(config, model, runtime_dir, zctx)  # noqa: E731
        else:
            make = factory_for
        pool = Pool(config, make)
        app[POOL] = pool
        for model in config.models:
            pool.add(model)
        try:
            yield
        finally:
            await pool.stop()
            if zctx is not None:
                zctx.term()
            if runtime_dir is not None:
                remove_runtime_dir(runtime_dir)
    return ctx
