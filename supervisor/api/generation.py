"""The one request flow behind /v1/chat/completions and /v1/completions.

Admission → wait for `started` (errors before the first byte get their real HTTP
status: 400 context too long, 503 queue full/timeout) → stream SSE chunks or collect
one body. Leaving for any reason (done, error, client gone: aiohttp cancels the handler)
closes the handle, which cancels the worker's sequence if it is still running.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Protocol

from aiohttp import web

from supervisor.api import shapes, sse
from supervisor.errors import APIError, get_request_id
from supervisor.keys import CONFIG, POOL

log = logging.getLogger("mlxd.api")

PING_INTERVAL = 15.0  # seconds of silence before a `: ping` comment on a stream


class Flavor(Protocol):
    """What differs between chat and legacy completions: the object shapes."""
    id_prefix: str
    # Chat chunks carry `"usage": null` until the last when usage is asked for (OpenAI's
    # spec makes it nullable there); completion chunks just leave it out.
    null_usage: bool

    def first_chunk(self, rid: str, created: int, model: str) -> dict | None: ...
    def text_chunk(self, rid: str, created: int, model: str, text: str) -> dict: ...
    def final_chunk(self, rid: str, created: int, model: str, finish_reason: str) -> dict: ...
    def usage_chunk(self, rid: str, created: int, model: str, usage: dict) -> dict: ...
    def body(self, rid: str, created: int, model: str, text: str, finish_reason: str,
             usage: dict) -> dict: ...


def finish_reason(reason: str) -> str:
    """OpenAI's enum has no "cancelled"/"error": a cancelled generation stopped early."""
    return reason if reason in ("stop", "length", "tool_calls", "content_filter") else "stop"


async def run(request: web.Request, parsed, flavor: Flavor) -> web.StreamResponse:
    config = request.app[CONFIG]
    runner = request.app[POOL].get(parsed.model)
    handle = runner.submit(parsed.to_generate_fields())
    rid = f"{flavor.id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = runner.id
    t0 = time.monotonic()
    outcome = "error"
    try:
        started = await handle.started(config.queue_timeout)
        deadline = time.monotonic() + config.request_timeout
        if parsed.stream:
            resp = await _stream(request, parsed, flavor, handle, started, deadline,
                                 rid, created, model)
        else:
            text = []
            async for batch in handle.deltas(deadline):
                text.extend(d.text for d in batch)
            done = handle.done
            usage = shapes.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
            resp = web.json_response(flavor.body(rid, created, model, "".join(text),
                                                 finish_reason(done.finish_reason), usage))
        outcome = handle.done.finish_reason if handle.done else "error"
        return resp
    finally:
        handle.close()
        done = handle.done
        log.info("request %s model=%s stream=%s outcome=%s prompt_tokens=%s "
                 "completion_tokens=%s queued_ms=%.0f total_ms=%.0f",
                 get_request_id(request), model, parsed.stream,
                 outcome if not handle.cancel_requested or outcome != "error" else "cancelled",
                 done.prompt_tokens if done else "-", done.completion_tokens if done else "-",
                 ((handle.started_at or time.monotonic()) - handle.created) * 1000,
                 (time.monotonic() - t0) * 1000)


async def _stream(request, parsed, flavor: Flavor, handle, started, deadline, rid, created,
                  model) -> web.StreamResponse:
    null_usage = parsed.include_usage and flavor.null_usage
    resp = await sse.open_stream(request)

    def event(obj: dict) -> bytes:
        if null_usage:
            obj["usage"] = None
        return sse.encode_event(obj)

    first = flavor.first_chunk(rid, created, model)
    if first is not None:
        await resp.write(event(first))
    try:
        async for batch in handle.deltas(deadline, idle=PING_INTERVAL):
            if not batch:
                await resp.write(sse.PING)
                continue
            text = "".join(d.text for d in batch)
            if text:
                await resp.write(event(flavor.text_chunk(rid, created, model, text)))
    except APIError as e:
        # The status line has gone out: the error travels as the stream's last event.
        await resp.write(sse.error_event(e))
        return resp
    done = handle.done
    await resp.write(event(flavor.final_chunk(rid, created, model, finish_reason(done.finish_reason))))
    if parsed.include_usage:
        usage = shapes.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        await resp.write(sse.encode_event(flavor.usage_chunk(rid, created, model, usage)))
    await resp.write(sse.DONE)
    await resp.write_eof()
    return resp
