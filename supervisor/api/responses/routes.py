"""The /v1/responses routes, the store's lifecycle and the registry of live runs.

The store can fail while the server runs (supervisor/api/responses/store.py says how it notices and
comes back). Generation does not depend on it: chat/completions never touch it, and a
Response with `store: false` and no `previous_response_id` neither. What needs it answers
503 `store_unavailable` (with Retry-After) while it is down, checked before any work is
given to a model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field

from aiohttp import web

from supervisor.http import sse
from supervisor.api.fields.paging import page
from supervisor.api.fields.params import invalid_value
from supervisor.api.responses.builder import replay
from supervisor.api.responses.items import output_to_items
from supervisor.api.responses.request import ResponsesRequest, parse_responses_request
from supervisor.api import lifecycle
from supervisor.api.conversations import turns
from supervisor.api.responses import summary
from supervisor.api.responses.runs import Run
from supervisor.http.errors import SERVER_ERROR, APIError, read_json
from supervisor.workers.errors import Internal, WorkerError
from supervisor.keys import CONFIG, POOL
from supervisor.api.responses.store import ChainError, ResponseStore, SchemaTooNew, StoreUnavailable

log = logging.getLogger("mlxd.responses")
CANCEL_WAIT_S = 10.0  # how long POST .../cancel waits for the run to end before answering


@dataclass
class Responses:
    store: ResponseStore
    max_chain_depth: int
    runs: dict = field(default_factory=dict)  # id → Run, while generating


RESPONSES = web.AppKey("responses", Responses)


def setup(app: web.Application) -> None:
    app.cleanup_ctx.append(_store_ctx)
    r = app.router
    r.add_post("/v1/responses", create)
    r.add_get("/v1/responses/{id}", retrieve)
    r.add_delete("/v1/responses/{id}", delete)
    r.add_get("/v1/responses/{id}/input_items", input_items)
    r.add_post("/v1/responses/{id}/cancel", cancel)


async def _store_ctx(app: web.Application):
    config = app[CONFIG]
    store = ResponseStore(config.state_dir / "responses.db", max_count=config.store_max_count,
                          max_age_s=config.store_max_age)
    try:
        failed = await store.open()
    except SchemaTooNew as e:
        # The one store problem that stops the start (api/responses/store.py says why): one clear
        # line, no traceback, a distinct exit status.
        await store.close()
        log.error("cannot start: %s", e)
        raise SystemExit(2) from None
    if failed:
        log.warning("%d responses were in progress when the server last stopped; marked failed",
                    failed)
    app[RESPONSES] = Responses(store, config.max_chain_depth)
    try:
        yield
    finally:
        await _end_runs(app[RESPONSES])
        await store.close()


async def _end_runs(svc: Responses) -> None:
    """Shutdown: cancel what still generates, give it a moment to record its end, then
    stop the runs still retrying a final write the store refused (that write is lost
    with this process; the next start marks such responses failed)."""
    runs = list(svc.runs.values())
    for run in runs:
        run.cancel()
    waiters = [asyncio.ensure_future(r.finished.wait()) for r in runs]
    if waiters:
        await asyncio.wait(waiters, timeout=5)
        for w in waiters:
            w.cancel()
    tasks = [r.task for r in runs if r.task is not None and not r.task.done()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def store_unavailable(e: StoreUnavailable) -> APIError:
    # 503 + Retry-After: the SDKs retry it, and it is the server's fault, not the request's.
    return APIError(503, str(e), SERVER_ERROR, None, "store_unavailable",
                    {"Retry-After": str(max(1, math.ceil(e.retry_after)))})


def needs_store(handler):
    """The handler's StoreUnavailable as the 503 a client can act on."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except StoreUnavailable as e:
            raise store_unavailable(e) from None
    return wrapped


async def conversation(svc: Responses, req: ResponsesRequest) -> list:
    """The items the model reads: the stored chain before `previous_response_id`, then
    this request's input (or the conversation's items, then the input)."""
    if req.conversation is not None:
        return await turns.prefix(svc.store, req.conversation, req.input_items)
    if req.previous_response_id is None:
        return list(req.input_items)
    try:
        chain = await svc.store.chain(req.previous_response_id, svc.max_chain_depth)
    except ChainError as e:
        if e.missing_id is not None:
            raise APIError(404, str(e), param="previous_response_id",
                           code="previous_response_not_found") from None
        raise APIError.bad_request(str(e), "previous_response_id") from None
    items = []
    for rec in chain:
        items += rec.input_items + output_to_items(rec.response.get("output") or [])
    return items + list(req.input_items)


def _check_tool_outputs(items: list) -> None:
    """Every function_call_output answers a function_call before it (the chain's or the
    input's): OpenAI refuses an orphan, and some chat templates fail on one. After a
    compaction item nothing is checked: its summary may hold the call."""
    calls = set()
    for item in items:
        if item["type"] == "compaction":
            return
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise APIError.bad_request("No tool call found for function call output with "
                                       f"call_id {item['call_id'][:128]}.", "input")


async def prepare(request: web.Request, req: ResponsesRequest, items: list | None = None) -> Run:
    """A new response's run, its generation queued on the model. The conversation is read
    from the store unless `items` gives it (WebSocket mode's in-connection cache).
    POST /v1/responses and WebSocket mode (api/responses/websocket.py) both start here."""
    svc = request.app[RESPONSES]
    if req.store:
        await svc.store.check()  # a store that is down refuses before the model works
    runner = await request.app[POOL].get(req.model)
    if items is None:
        items = await conversation(svc, req)
    if req.conversation is not None:
        req = dataclasses.replace(req, resume_from=await turns.resume_point(svc.store,
                                                                            req.conversation))
    _check_tool_outputs(items)
    # Compaction items expanded; with context_management, compacted past its threshold.
    builder, message = await summary.start(request, runner, req, items)
    gen = await lifecycle.queue(request, runner, message, {"max_tokens": "max_output_tokens"})
    return Run(builder, gen, svc.store if req.store else None, req.input_items,
               turns.appender(svc.store, req.conversation) if req.conversation else None)


async def launch(svc: Responses, run: Run) -> None:
    """A foreground run: wait until the worker took the prompt and the store has the
    response in progress, then generate in a task of its own, registered while it runs.
    Its caller follows its events and cancels it when its client leaves."""
    try:
        await run.wait_started()
        await run.save("in_progress")  # the store can still fail here: stop the generation
    except BaseException:
        run.handle.close()
        raise
    svc.runs[run.id] = run
    run.task = asyncio.create_task(run.generate())
    run.task.add_done_callback(lambda _: svc.runs.pop(run.id, None))


@needs_store
async def create(request: web.Request) -> web.StreamResponse:
    req = parse_responses_request(await read_json(request))
    svc = request.app[RESPONSES]
    run = await prepare(request, req)
    headers = {}
    if req.skipped_tools:
        headers["X-MLXD-Warning"] = ("skipped tools this server cannot run: "
                                     + ", ".join(sorted(set(req.skipped_tools))))
    if req.background:
        return await _background(svc, run, headers)
    await launch(svc, run)
    try:
        if req.stream:
            return await _stream(request, run, headers)
        await asyncio.shield(run.finished.wait())
        return web.json_response(run.builder.response(), headers=headers)
    except asyncio.CancelledError:
        run.cancel()  # a foreground run ends with its client
        raise


async def _background(svc: Responses, run: Run, headers: dict) -> web.Response:
    """Answer at once with the queued response; generate detached from this connection."""
    run.builder.status = "queued"
    try:
        await run.save("queued")
    except BaseException:
        run.handle.close()
        raise
    svc.runs[run.id] = run

    async def detached():
        try:
            await run.wait_started()
        except (APIError, WorkerError) as e:
            run.handle.close()
            await run.fail_before_start(e)
            return
        except Exception:  # a bug: the response must still end, never stay `queued`
            log.exception("response %s: failed before it started", run.id)
            run.handle.close()
            await run.fail_before_start(Internal())
            return
        run.builder.status = "in_progress"
        await run.generate()

    run.task = asyncio.create_task(detached())
    run.task.add_done_callback(lambda _: svc.runs.pop(run.id, None))
    return web.json_response(run.builder.response(), headers=headers)


async def _stream(request: web.Request, run: Run, headers: dict, start: int = 0):
    resp = await sse.open_stream(request, headers=headers)
    async for event in run.follow(start):
        await resp.write(sse.encode_event(event))
    await resp.write_eof()
    return resp


async def _stored(request: web.Request):
    svc = request.app[RESPONSES]
    rid = request.match_info["id"]
    rec = await svc.store.get(rid)
    if rec is None:
        raise APIError(404, f"Response with id '{rid}' not found.", param="response_id",
                       code="not_found")
    return svc, rec


@needs_store
async def retrieve(request: web.Request) -> web.StreamResponse:
    svc, rec = await _stored(request)
    run = svc.runs.get(rec.id)
    if request.query.get("stream") in ("true", "1"):
        start = _starting_after(request)
        if run is not None:
            return await _stream(request, run, {}, start)
        resp = await sse.open_stream(request)
        for event in replay(rec.response)[start:]:
            await resp.write(sse.encode_event(event))
        await resp.write_eof()
        return resp
    return web.json_response(run.builder.response() if run is not None else rec.response)


def _starting_after(request: web.Request) -> int:
    raw = request.query.get("starting_after")
    if raw is None:
        return 0
    try:
        return int(raw) + 1
    except ValueError:
        raise invalid_value("starting_after", "expected an integer sequence number.") from None


@needs_store
async def delete(request: web.Request) -> web.Response:
    svc, rec = await _stored(request)
    run = svc.runs.get(rec.id)
    if run is not None:
        run.cancel()
    await svc.store.delete(rec.id)
    return web.json_response({"id": rec.id, "object": "response", "deleted": True})


@needs_store
async def input_items(request: web.Request) -> web.Response:
    _, rec = await _stored(request)
    return web.json_response(page(rec.input_items, request.query, "input item"))


@needs_store
async def cancel(request: web.Request) -> web.Response:
    svc, rec = await _stored(request)
    if not rec.response.get("background"):
        raise APIError.bad_request("Only background responses can be cancelled.", "response_id")
    run = svc.runs.get(rec.id)
    if run is None:  # already finished: cancelling is a no-op
        return web.json_response(rec.response)
    run.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(run.finished.wait()), CANCEL_WAIT_S)
    except asyncio.TimeoutError:
        pass  # the cancel is on its way (a kill, past --cancel-grace): answer as it stands
    return web.json_response(run.builder.response())
