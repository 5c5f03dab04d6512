"""`/admin/*`: what mlxctl talks to, on the same server as the API.

Two locks on the door (the `admin_auth` middleware): the peer must be on this machine
(loopback; 403 otherwise, token or not) and must present the admin token from the state
directory as `Authorization: Bearer` (401 if missing or wrong, whatever bytes it holds).
Operations that take a while (swap, load, unload) run shielded: a client that gives up
does not leave a swap half done. The admin may load any local path; requests only what
lies inside the model roots.

    GET  /admin/status   server, memory and per-worker state (mlxctl status)
    GET  /admin/models   local MLX models with sizes, and which are loaded
    POST /admin/swap     {"model", "mode": "drain"|"force", "replace": [ids]?}
    POST /admin/load     {"model"}            POST /admin/unload {"model", "mode"?}
    POST /admin/kill     {"model"?, "restart": true}   (no model: every worker)
    GET  /admin/cache, POST /admin/cache/{save,drop,clear}: KV snapshots (admin/cache.py)
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import time
from dataclasses import dataclass

from aiohttp import web

from supervisor.admin import cache, files, logs
from supervisor.admin.token import ensure_token
from supervisor.config import Config
from supervisor.http.errors import APIError, read_json
from supervisor.keys import CONFIG, POOL
from supervisor.api.models import LOCAL_MODELS, NOT_LOADED
from supervisor.memory.probe import MemoryReading
from supervisor.http.metrics import rss_bytes
from supervisor.workers.runner import DRAIN, FORCE

PREFIX = "/admin"


@dataclass
class AdminState:
    token: str | None = None
    started_at: float = 0.0     # monotonic, for the server's uptime


ADMIN = web.AppKey("admin", AdminState)


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def bearer(header: str) -> str | None:
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def same_token(given: str, token: str) -> bool:
    """Constant-time comparison that no header can make raise. aiohttp decodes header
    bytes that are not UTF-8 as lone surrogates (surrogateescape), which plain
    `.encode()` refuses; compare_digest refuses non-ASCII str. Bytes with surrogatepass
    take any str, so a garbled header is just a wrong token."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                               token.encode("utf-8", "surrogatepass"))


def check_admin(request: web.Request) -> None:
    if not is_loopback(request.remote):
        raise APIError.forbidden("The admin API answers only on this machine (loopback).")
    token = request.app[ADMIN].token
    given = bearer(request.headers.get("Authorization", ""))
    if given is None:
        raise APIError.unauthorized(
            "The admin API needs the admin token as `Authorization: Bearer TOKEN`; "
            "mlxctl reads it from the server's state directory.")
    if token is None or not same_token(given, token):
        raise APIError.unauthorized("Wrong admin token.")


@web.middleware
async def admin_auth(request: web.Request, handler) -> web.StreamResponse:
    if request.path == PREFIX or request.path.startswith(PREFIX + "/"):
        check_admin(request)
    return await handler(request)


# ---- request bodies --------------------------------------------------------------------

def _model(body: dict, required: bool = True) -> str | None:
    model = body.get("model")
    if model is None and not required:
        return None
    if not isinstance(model, str) or not model.strip():
        raise APIError.bad_request("`model` must be a model id, path or Hugging Face id.", "model")
    return model.strip()


def _mode(body: dict) -> str:
    mode = body.get("mode", DRAIN)
    if mode not in (DRAIN, FORCE):
        raise APIError.bad_request("`mode` must be `drain` or `force`.", "mode")
    return mode


# ---- handlers --------------------------------------------------------------------------

def _measure(probe, pids: list[int | None]) -> tuple[MemoryReading | None, dict, int | None]:
    """Blocking readings, done in a thread: memory, RSS of each worker and of us."""
    try:
        reading = probe()
    except Exception:
        reading = None
    return reading, {pid: rss_bytes(pid) for pid in pids if pid}, rss_bytes(os.getpid())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxd")
    except PackageNotFoundError:
        return "unknown"


async def status(request: web.Request) -> web.Response:
    pool, config, state = request.app[POOL], request.app[CONFIG], request.app[ADMIN]
    health = pool.health()
    workers = health.workers
    reading, rss, own_rss = await asyncio.to_thread(
        _measure, pool.gate.probe, [w["pid"] for w in workers])
    for w in workers:
        w["rss_bytes"] = rss.get(w["pid"])
    return web.json_response({
        "status": health.state.value, "reason": health.reason,
        "server": {"pid": os.getpid(), "version": _version(), "rss_bytes": own_rss,
                   "uptime_s": round(time.monotonic() - state.started_at, 1),
                   "state_dir": str(config.state_dir),
                   "log_file": str(config.logs() / "mlxd.log")},
        "memory": reading.to_dict() if reading else None,
        "limits": {"max_models": config.max_models, "memory_budget": config.memory_budget,
                   "keep_alive": config.keep_alive,
                   "allow_load_on_request": config.allow_load_on_request,
                   "model_roots": [str(r) for r in await asyncio.to_thread(pool.roots)]},
        "workers": workers,
        # Why recent requests got `model_not_found` or a failed load (clients see one 404).
        "rejected_loads": list(pool.rejections),
    })


async def models(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    local = {m.id: m.to_dict() for m in await request.app[LOCAL_MODELS].all()}
    for r in list(pool.runners.values()):  # a loaded path model is not in the HF cache
        if r.id not in local:
            m = await request.app[LOCAL_MODELS].one(r.id, anywhere=True)
            if m is not None:
                local[r.id] = m.to_dict()
    out = []
    for m in local.values():
        runner = pool.find(m["id"])
        out.append({**m, "state": runner.state if runner else NOT_LOADED})
    return web.json_response({"models": sorted(out, key=lambda m: m["id"])})


async def swap(request: web.Request) -> web.Response:
    body = await read_json(request)
    replace = body.get("replace")
    if replace is not None and not (isinstance(replace, list)
                                    and all(isinstance(x, str) for x in replace)):
        raise APIError.bad_request("`replace` must be a list of model ids.", "replace")
    result = await asyncio.shield(request.app[POOL].swap(_model(body), _mode(body), replace))
    return web.json_response(result.to_dict())


async def load(request: web.Request) -> web.Response:
    runner = await asyncio.shield(request.app[POOL].load(_model(await read_json(request))))
    return web.json_response({"model": runner.id, "state": runner.state,
                              "context_length": runner.context_length})


async def unload(request: web.Request) -> web.Response:
    body = await read_json(request)
    model = await asyncio.shield(request.app[POOL].unload(_model(body), _mode(body)))
    return web.json_response({"model": model, "state": "unloaded"})


async def kill(request: web.Request) -> web.Response:
    body = await read_json(request)
    restart = body.get("restart", True)
    if not isinstance(restart, bool):
        raise APIError.bad_request("`restart` must be a boolean.", "restart")
    pool = request.app[POOL]
    model = _model(body, required=False)
    names = [model] if model is not None else [r.id for r in pool.runners.values()]
    if not names:
        raise APIError(409, "No model is loaded.", "invalid_request_error", None, "no_model")
    killed = await asyncio.shield(asyncio.gather(*(pool.kill(n, restart=restart) for n in names)))
    return web.json_response({"killed": list(killed)})


def setup(app: web.Application, config: Config) -> None:
    app[ADMIN] = AdminState()
    app.middlewares.append(admin_auth)
    app.on_startup.append(_create_token)
    r = app.router
    r.add_get(PREFIX + "/status", status)
    r.add_get(PREFIX + "/models", models)
    r.add_post(PREFIX + "/swap", swap)
    r.add_post(PREFIX + "/load", load)
    r.add_post(PREFIX + "/unload", unload)
    r.add_post(PREFIX + "/kill", kill)
    cache.setup(r, PREFIX)
    files.setup(r, PREFIX)
    logs.setup(r, PREFIX)


async def _create_token(app: web.Application) -> None:
    state = app[ADMIN]
    state.token = await asyncio.to_thread(ensure_token, app[CONFIG].state_dir)
    state.started_at = time.monotonic()
