"""One API request as the supervisor tracks it, from admission to its terminal event.

A `RequestHandle` is created by the runner on admission and fed by the runner's event
reader; the HTTP handler consumes it. The handler never talks to a worker: it awaits
`started()`, iterates `deltas()` and calls `close()` (which cancels if unfinished).
Attempts: if the worker dies before the request started, the runner re-queues it under a
new rid (request ids are unique per attempt); once started, a death is a failure.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from typing import AsyncIterator, Callable

from protocol import Audio, Delta, Done, FinishReason, Generate, Pooled, Started, Tokens, Transcript
from supervisor.workers.errors import (Internal, Overloaded, RequestTimeout, WorkerError,
                                       WorkerFailed)

# A client this many step messages behind is cancelled rather than buffered forever.
MAX_PENDING_EVENTS = 8192

QUEUED, DISPATCHED, STARTED, FINISHED = "queued", "dispatched", "started", "finished"


def _wake(w: asyncio.Future) -> None:
    if not w.done():
        w.set_result(None)


class Inbox:
    """The events of one request, from the runner's reader to the handler: a deque and at
    most one waiter future. (An asyncio.Queue plus wait_for costs a task and several
    callbacks per token, which at ~1 ms a token shows up as lost decode speed.)"""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float) -> bool:
        """Until an item is there (True) or `timeout` seconds pass (False)."""
        if self._items:
            return True
        if timeout <= 0:
            return False
        # One future and one timer that resolves it: asyncio.wait_for would add a second
        # future, a done callback and a partial per wait, and a stream waits once a message.
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake, w)
        try:
            await w
        finally:
            timer.cancel()
            self._waiter = None
        return bool(self._items)

    def popleft(self):
        return self._items.popleft()

    def drain(self) -> list:
        items = list(self._items)
        self._items.clear()
        return items


class RequestHandle:
    def __init__(self, model: str, request: Generate, *,
                 on_cancel: Callable[["RequestHandle"], None]):
        self.id = uuid.uuid4().hex[:24]
        self.model = model
        self.request = request          # complete, less its rid (stamped per attempt)
        self.state = QUEUED
        self.attempt = 0
        self.rid: str | None = None     # the current attempt's rid
        self.created = time.monotonic()
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None   # with first_token_at: inter-token latency
        self.started_msg: Started | None = None
        self.done: Done | None = None
        self.result: Tokens | Pooled | Transcript | None = None  # what a task other than
        #                                                            generation computed
        self.failure: WorkerError | None = None
        self.cancel_requested = False
        self.cancel_sent_at: float | None = None
        self.cancel_sent_steps = 0      # the worker's step count when the cancel went
        self._events = Inbox()
        self._on_cancel = on_cancel

    # ---- fed by the runner -----------------------------------------------------------
    def new_attempt(self) -> str:
        self.attempt += 1
        self.rid = f"{self.id}-{self.attempt}"
        self.state = DISPATCHED
        return self.rid

    def requeue(self) -> None:
        self.state = QUEUED
        self.rid = None
        self.cancel_sent_at = None

    def rebind(self, on_cancel: Callable[["RequestHandle"], None]) -> None:
        """Another runner of the same model takes this never-started request over."""
        self.requeue()
        self._on_cancel = on_cancel

    def on_started(self, msg: Started) -> None:
        self.state = STARTED
        self.started_at = time.monotonic()
        self.started_msg = msg
        self._events.put(msg)

    def on_delta(self, msg: Delta | Audio) -> bool:
        """Queue a step's output (text, or a synthesis' audio); False if the client has
        fallen too far behind."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self._events.put(msg)
        return len(self._events) <= MAX_PENDING_EVENTS

    def on_result(self, msg: Tokens | Pooled | Transcript) -> None:
        """What a task other than generation computed; its Done follows."""
        self.result = msg

    def on_done(self, msg: Done) -> None:
        if self.state == FINISHED:
            return
        self.state = FINISHED
        self.done = msg
        self._events.put(msg)

    def fail(self, error: WorkerError) -> None:
        """End the request with an error (worker died mid-stream, worker error, ...)."""
        if self.state == FINISHED:
            return
        if self.failure is None:
            self.failure = error
        self.state = FINISHED
        self._events.put(error)

    def set_failure(self, error: WorkerError) -> None:
        """Record the error a worker reported; its Done follows."""
        if self.failure is None:
            self.failure = error

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    # ---- used by the HTTP handler ----------------------------------------------------
    async def started(self, timeout: float) -> Started:
        """Wait until the worker has the prompt checked and prefill begins.

        Raises the domain error (supervisor/workers/errors.py) that ended it: context
        too long, waited in the queue too long, worker failed, ..."""
        if not await self._events.wait(timeout):
            self.cancel()
            raise Overloaded(
                f"The request waited more than {timeout:g} s for model `{self.model}`; "
                "the server is busy, please retry.", retry_after_s=max(1, int(timeout // 4)))
        item = self._events.popleft()
        return self._check_first(item)

    def _check_first(self, item) -> Started:
        if isinstance(item, Started):
            return item
        if isinstance(item, WorkerError):
            raise item
        if isinstance(item, Done):
            if self.failure is not None:
                raise self.failure
            raise WorkerFailed("The request was cancelled before it started.")
        raise Internal()

    async def deltas(self, deadline: float, idle: float | None = None
                     ) -> AsyncIterator[list[Delta | Audio]]:
        """Yield the step outputs as they come, several at once when the client lags
        (coalescing). Ends after the Done (then `self.done` is set); raises WorkerError on
        a failure, and cancels then raises 504 once `deadline` (monotonic) passes.
        With `idle`, an empty list comes after that many quiet seconds (for pings)."""
        while True:
            remaining = deadline - time.monotonic()
            wait = remaining if idle is None else min(remaining, idle)
            if not await self._events.wait(wait):
                if wait < remaining:
                    yield []
                    continue
                self.cancel()
                raise RequestTimeout(
                    "The request exceeded the server's request timeout and was cancelled.")
            batch = []
            for item in self._events.drain():
                if isinstance(item, (Delta, Audio)):
                    batch.append(item)
                    continue
                if batch:
                    yield batch
                    batch = []
                if isinstance(item, WorkerError):
                    raise item
                if isinstance(item, Done):
                    if self.failure is not None or item.finish_reason == FinishReason.ERROR:
                        raise self.failure or Internal()
                    return
            if batch:
                yield batch

    def cancel(self) -> None:
        """Idempotent: drop from the queue or tell the worker; no-op once finished."""
        if self.finished or self.cancel_requested:
            return
        self.cancel_requested = True
        self._on_cancel(self)

    def close(self) -> None:
        """The handler is leaving (done, error, client gone): cancel if unfinished."""
        self.cancel()
