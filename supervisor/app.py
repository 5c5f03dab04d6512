"""The aiohttp application factory.

Middlewares, outermost first: metrics (sees every final status), errors (the OpenAI
envelope, X-Request-ID), the guard (API keys, Host, JSON content type, CORS:
http/guard.py), admin auth (only for /admin/*). Shutdown (SIGTERM/SIGINT):
aiohttp stops listening, then `_drain_then_cancel` lets accepted requests finish for up
to --shutdown-timeout and cancels the rest, then the pool stops the workers.
"""

from __future__ import annotations

import logging

import zmq.asyncio
from aiohttp import web

from protocol.sockets import make_runtime_dir, remove_runtime_dir
from supervisor.admin import routes as admin
from supervisor.api import audio, health, tokenize
from supervisor.api import models as listing
from supervisor.api.chat import routes as chat
from supervisor.api.completions import routes as completions
from supervisor.api.conversations import routes as conversations
from supervisor.api.fields import remote_media
from supervisor.api.messages import routes as messages
from supervisor.api.pooling import routes as pooling
from supervisor.api.responses import compact, counts
from supervisor.api.responses import routes as responses
from supervisor.api.responses import websocket as responses_ws
from supervisor.http import guard, metrics, serving
from supervisor.config import Config
from supervisor.http.errors import BODY_TIMEOUT, install
from supervisor.keys import CONFIG, POOL
from supervisor.memory.probe import Probe
from supervisor.workers.launch import process_link_factory
from supervisor.workers.pool import Pool
from supervisor.ui import routes as pages

log = logging.getLogger("mlxd")


def create_app(config: Config, *, factory_for=None, probe: Probe | None = None) -> web.Application:
    """`factory_for(model) -> LinkFactory` replaces real worker processes and `probe`
    the memory readings (tests)."""
    app = web.Application(client_max_size=config.max_body_bytes)
    install(app)
    metrics.install(app)
    guard.install(app, guard.Guard.from_config(config))
    serving.install(app)
    app[BODY_TIMEOUT] = config.body_timeout or None
    admin.setup(app, config)
    app[CONFIG] = config
    remote_media.install(app, config)
    app.cleanup_ctx.append(_workers(factory_for, probe))
    app.on_shutdown.append(_drain_then_cancel)
    chat.setup(app)
    completions.setup(app)
    listing.setup(app, config)
    health.setup(app)
    compact.setup(app)  # POST /v1/responses/compact
    counts.setup(app)  # POST /v1/responses/input_tokens
    responses.setup(app)
    responses_ws.setup(app)  # GET /v1/responses: WebSocket mode
    conversations.setup(app)
    pooling.setup(app)
    tokenize.setup(app)
    messages.setup(app)
    audio.setup(app)
    if config.web_ui:
        pages.setup(app)
    return app


async def _drain_then_cancel(app: web.Application) -> None:
    """Shutdown, before aiohttp waits for handlers: refuse new requests, give accepted
    ones --shutdown-timeout to finish, then end the rest (queued ones at once, running
    ones through a cancel) so no stream holds the exit up."""
    pool, timeout = app[POOL], app[CONFIG].shutdown_timeout
    busy = sum(len(r.queue) + len(r.inflight) for r in pool.all_runners())
    if busy:
        log.info("shutting down: letting %d request(s) finish (up to %g s)", busy, timeout)
    if not await pool.drain(timeout):
        log.warning("shutting down: requests still running after %g s are cancelled", timeout)
    pool.begin_shutdown()


def _workers(factory_for, probe: Probe | None):
    async def ctx(app: web.Application):
        config = app[CONFIG]
        zctx = runtime_dir = None
        if factory_for is None:
            runtime_dir = make_runtime_dir()
            zctx = zmq.asyncio.Context()
            make = lambda model: process_link_factory(config, model, runtime_dir, zctx)  # noqa: E731
        else:
            make = factory_for
        pool = Pool(config, make, probe=probe, observer=app[metrics.METRICS])
        app[POOL] = pool
        for model in config.models:
            pool.add(model, pinned=True)
        pool.start()
        try:
            yield
        finally:
            await pool.stop()
            if zctx is not None:
                zctx.term()
            if runtime_dir is not None:
                remove_runtime_dir(runtime_dir)
    return ctx
