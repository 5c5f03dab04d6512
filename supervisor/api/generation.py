"""The one request flow behind /v1/chat/completions and /v1/completions.

Admission → wait for `started` (errors before the first byte get their real HTTP
status: 400 context too long, 503 queue full/timeout) → stream SSE chunks or collect
one body. Leaving for any reason (done, error, client gone: aiohttp cancels the handler)
closes the handle, which cancels the worker's sequence if it is still running.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from aiohttp import web

from supervisor.api import shapes, sse
from supervisor.errors import APIError, get_request_id
from supervisor.keys import CONFIG, POOL

log = logging.getLogger("mlxd.api")


class Shapes(Protocol):
    """What differs between chat and legacy completions: the objects of one response."""

    def first_chunk(self) -> dict | None: ...
    def text_chunk(self, text: str) -> dict: ...
    def final_chunk(self, finish_reason: str) -> dict: ...
    def usage_chunk(self, usage: dict) -> dict: ...
    def body(self, text: str, finish_reason: str, usage: dict) -> dict: ...


async def run(request: web.Request, parsed,
              make_shapes: Callable[[str, int], Shapes]) -> web.StreamResponse:
    """`make_shapes(model, created)` gives the response's object builders."""
    config = request.app[CONFIG]
    runner = request.app[POOL].get(parsed.model)
    handle = runner.submit(parsed.to_generate_fields())
    model = runner.id
    objects = make_shapes(model, int(time.time()))
    t0 = time.monotonic()
    outcome = "error"
    try:
        await handle.started(config.queue_timeout)
        deadline = time.monotonic() + config.request_timeout
        if parsed.stream:
            resp = await _stream(request, parsed, objects, handle, deadline)
        else:
            text = []
            async for batch in handle.deltas(deadline):
                text.extend(d.text for d in batch)
            done = handle.done
            usage = shapes.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
            resp = web.json_response(objects.body("".join(text), done.finish_reason, usage))
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


async def _stream(request, parsed, objects: Shapes, handle, deadline: float) -> web.StreamResponse:
    resp = await sse.open_stream(request)
    first = objects.first_chunk()
    if first is not None:
        await resp.write(sse.encode_event(first))
    try:
        async for batch in handle.deltas(deadline, idle=sse.PING_INTERVAL_S):
            if not batch:
                await resp.write(sse.PING)
                continue
            text = "".join(d.text for d in batch)
            if text:
                await resp.write(sse.encode_event(objects.text_chunk(text)))
    except APIError as e:
        # The status line has gone out: the error travels as the stream's last event.
        await resp.write(sse.error_event(e))
        return resp
    done = handle.done
    await resp.write(sse.encode_event(objects.final_chunk(done.finish_reason)))
    if parsed.include_usage:
        usage = shapes.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        await resp.write(sse.encode_event(objects.usage_chunk(usage)))
    await resp.write(sse.DONE)
    await resp.write_eof()
    return resp
