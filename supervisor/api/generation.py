"""Chat and legacy completions over the one request lifecycle (api/stream.py).

Admission → wait for `started` (errors before the first byte get their real HTTP
status: 400 context too long or a bad schema, 503 queue full/timeout) → stream SSE
chunks or collect one body, rendered by the endpoint's Shapes. Leaving for any reason
(done, error, client gone: aiohttp cancels the handler) closes the generation, which
cancels the worker's sequence if it is still running. The request becomes one complete
protocol Generate, with the server's defaults, in one call (`to_generate`: api/parse/).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from aiohttp import web

from supervisor.api.fields.media import fetch_remote
from supervisor.api.render import shapes
from supervisor.api.render.output import Output, Part
from supervisor.http import sse
from supervisor.api.stream import Generation
from supervisor.http.errors import get_request_id
from supervisor.keys import CONFIG, POOL

log = logging.getLogger("mlxd.api")


class Shapes(Protocol):
    """What differs between chat and legacy completions: the objects of one response."""

    def first_chunk(self) -> dict | None: ...
    def chunks(self, part: Part) -> list[dict]: ...
    def final_chunk(self, finish_reason: str) -> dict: ...
    def usage_chunk(self, usage: dict) -> dict: ...
    def body(self, output: Output, finish_reason: str, usage: dict) -> dict: ...


def usage_of(done) -> dict:
    return shapes.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens,
                        done.reasoning_tokens)


async def submit(request: web.Request, model_name: str, message, params: dict | None = None):
    """`message` (a complete Generate, less its rid) queued on `model_name`'s runner:
    (the runner, its Generation under the server's queue and request timeouts). Its
    remote images are fetched first (fields/media.py)."""
    message = await fetch_remote(message, request.app)
    config = request.app[CONFIG]
    runner = await request.app[POOL].get(model_name)
    return runner, Generation(runner.submit(message, params),
                              queue_timeout=config.queue_timeout,
                              request_timeout=config.request_timeout,
                              logprobs=message.output.logprobs)


async def run(request: web.Request, parsed,
              make_shapes: Callable[[str, int], Shapes]) -> web.StreamResponse:
    """`make_shapes(model, created)` gives the response's object builders."""
    runner, gen = await submit(request, parsed.model, parsed.to_generate(request.app[CONFIG]))
    model = runner.id
    objects = make_shapes(model, int(time.time()))
    t0 = time.monotonic()
    try:
        await gen.started()
        if parsed.stream:
            return await _stream(request, parsed, objects, gen)
        output = await gen.collect()
        return web.json_response(objects.body(output, gen.done.finish_reason,
                                              usage_of(gen.done)))
    finally:
        gen.close()
        log_request(request, gen, model, parsed.stream, t0)


def log_request(request, gen: Generation, model: str, stream: bool, t0: float) -> None:
    h, done = gen.handle, gen.done
    outcome = done.finish_reason if done else "error"
    if h.cancel_requested and outcome == "error":
        outcome = "cancelled"
    log.info("request %s model=%s stream=%s outcome=%s prompt_tokens=%s "
             "completion_tokens=%s queued_ms=%.0f total_ms=%.0f",
             get_request_id(request), model, stream, outcome,
             done.prompt_tokens if done else "-", done.completion_tokens if done else "-",
             ((h.started_at or time.monotonic()) - h.created) * 1000,
             (time.monotonic() - t0) * 1000)


async def _stream(request, parsed, objects: Shapes, gen: Generation) -> web.StreamResponse:
    resp = await sse.open_stream(request)
    first = objects.first_chunk()
    if first is not None:
        await resp.write(sse.encode_event(first))
    # A failure from here on raises through: the error middleware, the one place that
    # does so, ends a stream whose status line went out with an error event.
    async for part in gen.parts(idle=sse.PING_INTERVAL_S):
        if part is None:
            await resp.write(sse.PING)
            continue
        for chunk in objects.chunks(part):
            await resp.write(sse.encode_event(chunk))
    done = gen.done
    await resp.write(sse.encode_event(objects.final_chunk(done.finish_reason)))
    if parsed.include_usage:
        await resp.write(sse.encode_event(objects.usage_chunk(usage_of(done))))
    await resp.write(sse.DONE)
    await resp.write_eof()
    return resp
