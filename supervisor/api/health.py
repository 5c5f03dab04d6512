"""GET /health (the model routes are in supervisor/api/models.py): the pool's
`HealthReport` as a status code and a body. The pool says its state and why; what that
means in HTTP (503 only when nothing serves, nor will by itself) is decided here alone."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from supervisor.api.responses.routes import RESPONSES
from supervisor.keys import POOL
from supervisor.workers.report import Health

# Every other state answers 200: a model serves, or one loads at the first request.
STATUS = {Health.UNAVAILABLE: 503}
STORE_DOWN = "the response store is unavailable: stored responses answer 503"


async def health(request: web.Request) -> web.Response:
    """Answered from cached state: never waits on a worker (nor on the store's disk).
    A store that is down leaves the HTTP status as it is (generation still serves) but
    makes an `ok` server `degraded`, with the reason: stored responses answer 503."""
    report = request.app[POOL].health()
    svc = request.app.get(RESPONSES)
    if svc is not None and not svc.store.available and report.state is Health.OK:
        report = dataclasses.replace(report, state=Health.DEGRADED, reasons=(STORE_DOWN,))
    body = {"status": report.state.value, "workers": report.workers}
    if report.reason:
        body["reason"] = report.reason
    if svc is not None:
        body["store"] = "ok" if svc.store.available else "unavailable"
    return web.json_response(body, status=STATUS.get(report.state, 200))


def setup(app: web.Application) -> None:
    app.router.add_get("/health", health)
