"""One request's life as every API surface sees it: submit, started, parts, done; and
the two ways a surface runs it: a generation streamed or collected (`run`, for chat and
legacy completions; Messages, Responses and audio drive a `Generation` themselves) and a
task that computes one result (`compute`: tokenize, embeddings, rerank scores).

Chat completions, legacy completions, Messages, Responses and audio differ only in how
they parse and render; the life of the request underneath is the same, and lives here
once, so admission, timeouts, cancelling and the request log cannot drift between them.

`Generation` wraps the worker-management handle:
- `started()` waits for the worker to take the prompt. Failures before that keep their
  own HTTP status (400 context too long or a bad schema, 503 busy): nothing has been
  sent yet.
- `parts()` yields the output as `Part`s, several worker steps folded into one when the
  client reads slower than the model writes; with `idle`, a `None` after that many quiet
  seconds (for SSE pings). A failure mid-way raises the domain error (or APIError).
- `done` is the terminal message (finish reason and usage) once `parts()` has ended.
- `close()` is idempotent and cancels the worker's sequence if it is still running; the
  surfaces call it whenever they leave, for any reason (a client gone included: aiohttp
  cancels the handler).

A request becomes one complete protocol Generate, with the server's defaults, in one call
(`to_generate`: each surface's request.py, from api/fields/).

`usage_of` and `wire_finish` are the usage object and the finish-reason rule that both
OpenAI shapes `run` renders (chat/shapes.py, completions/shapes.py) share.

Tasks (protocol Task) travel as a Generate with a `task`, so they share everything a
generation has: admission and --max-queue, the queue and request timeouts, cancel when
the client leaves, re-queueing when a worker dies before starting them, exactly one Done.
The worker sends the result (Tokens or Pooled) just before that Done; `compute` waits
for both.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Protocol

from aiohttp import web

from protocol import Done, Generate, Pooled, Started, Tokens
from supervisor.api import choices
from supervisor.api.fields.media import fetch_remote
from supervisor.api.output import Output, Part
from supervisor.http import sse
from supervisor.http.errors import get_request_id
from supervisor.keys import CONFIG, POOL
from supervisor.workers.errors import Internal
from supervisor.workers.handle import RequestHandle

log = logging.getLogger("mlxd.api")


class Generation:
    def __init__(self, handle: RequestHandle, *, queue_timeout: float,
                 request_timeout: float, logprobs: bool = False):
        self.handle = handle
        self.queue_timeout = queue_timeout
        self.request_timeout = request_timeout
        self.logprobs = logprobs
        self._deadline: Optional[float] = None

    async def started(self) -> Started:
        msg = await self.handle.started(self.queue_timeout)
        self._deadline = time.monotonic() + self.request_timeout
        return msg

    async def parts(self, idle: float | None = None) -> AsyncIterator[Part | None]:
        async for batch in self.batches(idle):
            yield Part.of(batch, self.logprobs) if batch else None

    async def batches(self, idle: float | None = None) -> AsyncIterator[list]:
        """The worker's step messages as they come (Deltas; a synthesis' Audio), several
        at once when the client lags; with `idle`, an empty list after quiet seconds."""
        if self._deadline is None:
            raise RuntimeError("parts() before started()")
        async for batch in self.handle.deltas(self._deadline, idle=idle):
            yield batch

    async def collect(self) -> Output:
        """The whole output, for a response that is not streamed."""
        output = Output()
        async for part in self.parts():
            output.add(part)
        return output

    @property
    def done(self) -> Done | None:
        return self.handle.done

    def close(self) -> None:
        self.handle.close()


class Shapes(Protocol):
    """What differs between chat and legacy completions: the objects of one response,
    each chunk for its choice `index` (api/choices.py)."""

    def first_chunk(self, index: int) -> dict | None: ...
    def chunks(self, part: Part, index: int) -> list[dict]: ...
    def final_chunk(self, finish_reason: str, index: int) -> dict: ...
    def usage_chunk(self, usage: dict) -> dict: ...
    def body(self, choices: list[tuple[Output, str]], usage: dict) -> dict: ...


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int = 0, accepted_prediction: int = 0,
          rejected_prediction: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens,
                                      "accepted_prediction_tokens": accepted_prediction,
                                      "rejected_prediction_tokens": rejected_prediction},
    }


def usage_of(gens: list[Generation], n: int = 1) -> dict:
    """The OpenAI usage object of a finished request's choices (chat and legacy
    completions; `n` choices a prompt: choices.py says how they add up)."""
    return usage(**choices.usage_parts([gen.done for gen in gens], n))


def wire_finish(table: dict, reason: str) -> str:
    """A protocol finish reason → its wire value in `table` (chat/shapes.py and
    completions/shapes.py hold one each). "error" has none: the handler answers with an
    error envelope or a final SSE error event instead, so mapping it raises."""
    try:
        return table[reason]
    except KeyError:
        raise ValueError(f"finish_reason {reason!r} has no wire value; an 'error' finish "
                         "must be answered with an APIError / SSE error event") from None


async def submit(request: web.Request, model_name: str, message, params: dict | None = None):
    """`message` (a complete Generate, less its rid) queued on `model_name`'s runner:
    (the runner, its Generation under the server's queue and request timeouts). Its
    remote images are fetched first (fields/media.py)."""
    message = await fetch_remote(message, request.app)
    runner = await request.app[POOL].get(model_name)
    return runner, _generation(request, runner, message, params)


async def queue(request: web.Request, runner, message, params: dict | None = None) -> Generation:
    """`submit` for a surface that took its runner first (Responses: the runner's id
    names the response's model before the message is built)."""
    return _generation(request, runner, await fetch_remote(message, request.app), params)


def _generation(request: web.Request, runner, message, params: dict | None) -> Generation:
    config = request.app[CONFIG]
    return Generation(runner.submit(message, params),
                      queue_timeout=config.queue_timeout,
                      request_timeout=config.request_timeout,
                      logprobs=message.output.logprobs)


async def run(request: web.Request, parsed,
              make_shapes: Callable[[str, int], Shapes]) -> web.StreamResponse:
    """`make_shapes(model, created)` gives the response's object builders. The request's
    choices (`n`, a legacy completion's prompts: api/choices.py) run side by side."""
    config = request.app[CONFIG]
    prompts = [await fetch_remote(m, request.app) for m in parsed.to_generates(config)]
    runner = await request.app[POOL].get(parsed.model)
    gens: list[Generation] = []
    t0 = time.monotonic()
    try:
        for message in choices.fan_out(prompts, parsed.n):
            gens.append(_generation(request, runner, message, None))
        objects = make_shapes(runner.id, int(time.time()))
        for gen in gens:
            await gen.started()
        if parsed.stream:
            return await _stream(request, parsed, objects, gens)
        outputs = await choices.collect(gens)
        return web.json_response(objects.body(
            [(output, gen.done.finish_reason) for output, gen in zip(outputs, gens)],
            usage_of(gens, parsed.n)))
    finally:
        for gen in gens:
            gen.close()
            log_request(request, gen, runner.id, parsed.stream, t0)


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


async def _stream(request, parsed, objects: Shapes, gens: list) -> web.StreamResponse:
    resp = await sse.open_stream(request)
    for index in range(len(gens)):
        first = objects.first_chunk(index)
        if first is not None:
            await resp.write(sse.encode_event(first))
    # A failure from here on raises through: the error middleware, the one place that
    # does so, ends a stream whose status line went out with an error event.
    async for event in choices.events(gens, idle=sse.PING_INTERVAL_S):
        if event is None:
            await resp.write(sse.PING)
            continue
        index, part = event
        if part is choices.END:
            chunk = objects.final_chunk(gens[index].done.finish_reason, index)
            await resp.write(sse.encode_event(chunk))
            continue
        for chunk in objects.chunks(part, index):
            await resp.write(sse.encode_event(chunk))
    if parsed.include_usage:
        await resp.write(sse.encode_event(objects.usage_chunk(usage_of(gens, parsed.n))))
    await resp.write(sse.DONE)
    await resp.write_eof()
    return resp


@dataclass(frozen=True)
class Computed:
    model: str                 # the served model's id
    result: Tokens | Pooled
    done: Done                 # its usage: prompt_tokens


async def compute(request: web.Request, model_name: str, message: Generate,
                  params: dict | None = None) -> Computed:
    """Run `message` (its task set, its rid not) on `model_name`'s worker. Raises the
    domain error that ended it, like a generation does (Generation above). A Pooled result
    has one row per input, checked here."""
    rows = len(message.inputs or message.input_ids or ())
    runner, gen = await submit(request, model_name, message, params)
    t0 = time.monotonic()
    try:
        await gen.started()
        async for _ in gen.parts():
            pass  # a task sends no Deltas; this waits for its Done (or its failure)
        result = gen.handle.result
        if result is None or (isinstance(result, Pooled) and result.rows != rows):
            raise Internal()  # a worker that ends a task without its result: our bug
        return Computed(runner.id, result, gen.done)
    finally:
        gen.close()
        log_request(request, gen, runner.id, False, t0)
