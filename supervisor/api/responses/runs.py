"""A Responses API generation in flight, decoupled from any one connection.

A `Run` drives one RequestHandle to its end and records every streaming event; whoever
wants them (the creating request's SSE stream, a later `GET ?stream=true`, or nobody for a
background response being polled) follows the list. Foreground runs are cancelled when
their client leaves; background runs live until done or `POST .../cancel`. The store is
updated when a run starts and when it ends, so a poll always finds the response.

A store that fails before the end of a run must not lose how it ended, nor crash the
task: the run's followers are released anyway, the run stays registered (so reads answer
from memory once the store answers again) and the final write is retried, paced by the
store's own reopen schedule, until it lands or the server stops.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from supervisor.api.fields.tools import only_tool
from supervisor.api.responses.builder import ResponseBuilder, usage
from supervisor.api.lifecycle import Generation
from supervisor.http.errors import APIError, api_error
from supervisor.workers.errors import BadRequest, WorkerError
from supervisor.api.responses.store import ResponseStore, StoredResponse, StoreUnavailable

log = logging.getLogger("mlxd.responses")


class Run:
    def __init__(self, builder: ResponseBuilder, gen: Generation, store: ResponseStore | None,
                 input_items: list, append=None):
        self.builder = builder
        self.gen = gen
        self.handle = gen.handle
        self.store = store
        self.input_items = input_items
        # A conversation's hook (api/conversations/turns.py), called once at the end
        # before the final write: its write is queued before any later request can read
        # the conversation (the store runs its work in order), so the next turn sees it.
        self.append = append
        self.events: list[dict] = []
        self.finished = asyncio.Event()
        self._changed = asyncio.Event()
        self.task: asyncio.Task | None = None
        self._final_written = False
        self.cancelled = False  # by its client (POST .../cancel, or gone), not by the server
        self.prompt: tuple[int, int] = (0, 0)  # (prompt, cached) tokens, once started
        self.produced = 0  # output tokens so far: a failed response's usage

    @property
    def id(self) -> str:
        return self.builder.id

    def _emit(self, events: list[dict]) -> None:
        if events:
            self.events.extend(events)
            self._changed.set()

    async def wait_started(self):
        """Until the worker took the prompt: errors before that are plain HTTP errors
        (400 context too long, 503 busy), not a failed response. The worker names the
        chat messages it was given (`messages[2].content`); this API's field is `input`
        (the messages also hold the instructions and the stored chain, so an index would
        mislead)."""
        try:
            started = await self.gen.started()
            self.prompt = (started.prompt_tokens, started.cached_tokens)
            return started
        except BadRequest as e:  # only the client's faults name a field
            if e.param and e.param.startswith("messages"):
                e.param = "input"
            raise

    async def save(self, status: str | None = None) -> None:
        if self.store is not None:
            b = self.builder
            await self.store.put(StoredResponse(
                b.id, float(b.created_at), status or b.status, b.response(), self.input_items,
                b.req.previous_response_id))

    async def _then(self, then) -> bool:
        """The first generation was a summary (summary.py `then`): read it whole, then
        start the answer it leads to; False when the run was cancelled meanwhile."""
        notes = "".join((await self.gen.collect()).text)
        self.gen.close()
        if self.cancelled or self.gen.done.finish_reason == "cancelled":
            return False
        events, self.gen = await then(notes)
        self.handle = self.gen.handle
        if self.cancelled:  # while it was queued
            self.handle.cancel()
        self._emit(events)
        await self.wait_started()
        return True

    async def generate(self) -> None:
        """After wait_started(): stream the worker's output into events, then finish."""
        b = self.builder
        self._emit(b.start())
        logprobs = []  # a token's logprobs wait for text (a token may end mid-character)
        try:
            then = getattr(b, "then", None)  # (a CompactingBuilder's)
            if then is not None and not await self._then(then):
                self._emit(b.finish("cancelled", usage=usage(0, 0)))  # no answer was read
                return
            gen = self.gen
            async for part in gen.parts():
                if not b.req.generate:
                    continue  # a warm-up: the state its prompt leaves is what it is for
                self.produced += part.tokens
                self._emit(b.reasoning(part.reasoning))
                logprobs += part.logprobs
                if part.text:
                    self._emit(b.text(part.text, logprobs=logprobs))
                    logprobs = []
                for call in part.tool_calls:
                    self._emit(b.function_call(call.name, call.arguments, call.id))
                if part.cut_call is not None:  # max_output_tokens ran out inside it
                    c = part.cut_call
                    name = c.name or only_tool(b.req.tools, b.req.tool_choice)
                    self._emit(b.function_call(name, c.arguments, c.id, status="incomplete"))
            done = gen.done
            u = usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens,
                      done.reasoning_tokens)
            if done.finish_reason == "cancelled":
                self._emit(b.finish("cancelled", usage=u))
            elif not b.req.generate:  # its one token is not output: none is counted
                self._emit(b.finish("completed", usage=usage(done.prompt_tokens, 0,
                                                             done.cached_tokens)))
            elif done.finish_reason == "length":
                self._emit(b.finish("incomplete", usage=u, incomplete_reason="max_output_tokens"))
            else:
                self._emit(b.finish("completed", usage=u))
        except (APIError, WorkerError) as e:
            # Mid-stream failures (worker died: retryable; timeout; a grammar the request
            # brought failing) end the response.
            self._emit(b.finish("failed", error=response_error(e),
                                usage=usage(self.prompt[0], self.produced, self.prompt[1])))
        finally:
            self.gen.close()
            await self._final_save()

    async def _final_save(self) -> None:
        try:
            retry_in = await self._write_final()
        finally:
            self.finished.set()
            self._changed.set()
        if retry_in is not None:
            log.warning("response %s ended %s while the store was unavailable; it is kept in "
                        "memory and written when the store is back", self.id, self.builder.status)
            while retry_in is not None:
                await asyncio.sleep(retry_in)
                retry_in = await self._write_final()
            log.info("response %s: the store is back; final state %s", self.id,
                     "written" if self._final_written else "dropped (its row is gone)")

    async def _write_final(self) -> float | None:
        """Record the end; None when done (or nothing to do), else seconds to the retry."""
        try:
            if self.append is not None:
                await self.append(self.builder.status, self.input_items, self.builder.output,
                                  self.id if self.store is not None else None)
                self.append = None  # done: a retry of the write below does not repeat it
            if self.store is None:
                return None
            self._final_written = await self.store.update(self.id, self.builder.status,
                                                          self.builder.response())
        except StoreUnavailable as e:
            return max(e.retry_after, 0.05)
        except Exception:  # a bug, not an outage: retrying would not help
            log.exception("response %s: could not record its final state", self.id)
        return None

    async def fail_before_start(self, error: APIError | WorkerError) -> None:
        """A background run that never started: cancelled while queued, or refused
        (context too long, waited too long in the queue, ...): the response says so
        rather than an HTTP error nobody is there to read."""
        nothing = usage(0, 0)  # no token was read or written
        if self.cancelled:  # the handle's own cancel_requested is also set by a timeout
            self._emit(self.builder.finish("cancelled", usage=nothing))
        else:
            log.warning("background response %s failed before it started: %s", self.id,
                        error.message)
            self._emit(self.builder.finish("failed", error=response_error(error),
                                           usage=nothing))
        await self._final_save()

    async def follow(self, start: int = 0) -> AsyncIterator[dict]:
        """Every event from `start`, as they come, until the run has finished."""
        i = start
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.finished.is_set():
                return
            self._changed.clear()
            if i < len(self.events):
                continue
            await self._changed.wait()

    def cancel(self) -> None:
        self.cancelled = True
        self.handle.cancel()


def response_error(e: APIError | WorkerError) -> dict:
    """A failure as a response's `error` (the spec's ResponseErrorCode): the request's
    own fault is `invalid_prompt`, anything else `server_error`."""
    e = api_error(e)  # the one map: the same message and status as on the HTTP path
    return {"code": "invalid_prompt" if e.status < 500 else "server_error",
            "message": e.message}
