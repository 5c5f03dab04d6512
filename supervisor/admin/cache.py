"""`/admin/cache*`: the loaded models' named KV snapshots (worker/snapshots/), as
llama-server's slot save/restore lets an operator keep a conversation's state.

    GET  /admin/cache          ?model=M: each text model's snapshots (memory and disk)
    POST /admin/cache/save     {"name", "model"?}  write a snapshot from memory to disk
    POST /admin/cache/drop     {"name", "model"?}  forget it in every tier
    POST /admin/cache/clear    {"model"?}          forget them all, and the prompt cache

Without `model`, every loaded text model is asked (a name is usually a response id, and
the operator need not know which model made it). Each worker answers on its MLX thread,
between two steps. A model that is not loaded has no worker to ask: its files stay in
STATE_DIR/kv until it is loaded again or they are deleted by hand.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from protocol.messages import ModelKind
from supervisor.http.errors import APIError, api_error, read_json
from supervisor.keys import POOL
from supervisor.workers.errors import WorkerError


def _runners(request: web.Request, model: str | None) -> list:
    pool = request.app[POOL]
    if model is not None:
        runner = pool.find(model)
        if runner is None:
            raise APIError(404, f"Model `{model}` is not loaded.", "invalid_request_error",
                           "model", "model_not_loaded")
        return [runner]
    return [r for r in pool.runners.values() if r.kind in (None, ModelKind.TEXT.value)]


async def _ask(runners: list, op: str, name: str | None) -> list[tuple]:
    """[(runner, reply or the error it raised)] for each runner, asked at once."""
    replies = await asyncio.gather(*(r.cache_command(op, name) for r in runners),
                                   return_exceptions=True)
    out = []
    for runner, reply in zip(runners, replies):
        if isinstance(reply, asyncio.TimeoutError):
            reply = APIError(504, f"Model `{runner.id}` did not answer in time.",
                             "server_error", None, "timeout")
        elif isinstance(reply, WorkerError):
            reply = api_error(reply)
        elif isinstance(reply, BaseException):
            raise reply
        out.append((runner, reply))
    return out


def _body_str(body: dict, key: str, required: bool) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise APIError.bad_request(f"`{key}` must be a non-empty string.", key)
    return value.strip()


async def ls(request: web.Request) -> web.Response:
    model = request.query.get("model") or None
    out = []
    for runner, reply in await _ask(_runners(request, model), "ls", None):
        if isinstance(reply, APIError) or not reply.ok:
            out.append({"model": runner.id, "error": reply.message})
        else:
            out.append({"model": runner.id,
                        "snapshots": [msgspec.structs.asdict(e) for e in reply.entries]})
    return web.json_response({"models": out})


async def _named(request: web.Request, op: str) -> web.Response:
    body = await read_json(request)
    name = _body_str(body, "name", required=op != "clear")
    runners = _runners(request, _body_str(body, "model", required=False))
    if not runners:
        raise APIError(409, "No model is loaded.", "invalid_request_error", None, "no_model")
    results = []
    for runner, reply in await _ask(runners, op, name):
        ok = not isinstance(reply, APIError) and reply.ok
        results.append({"model": runner.id, "ok": ok, "message": reply.message})
    if name is not None and not any(r["ok"] for r in results):
        raise APIError(404, "; ".join(f"{r['model']}: {r['message']}" for r in results),
                       "invalid_request_error", "name", "snapshot_not_found")
    return web.json_response({"results": results})


async def save(request: web.Request) -> web.Response:
    return await _named(request, "save")


async def drop(request: web.Request) -> web.Response:
    return await _named(request, "drop")


async def clear(request: web.Request) -> web.Response:
    return await _named(request, "clear")


def setup(router: web.UrlDispatcher, prefix: str) -> None:
    router.add_get(prefix + "/cache", ls)
    router.add_post(prefix + "/cache/save", save)
    router.add_post(prefix + "/cache/drop", drop)
    router.add_post(prefix + "/cache/clear", clear)
