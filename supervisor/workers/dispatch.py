"""Request dispatch for one model: admission, sending to the worker, cancels.

The runner (runner.py) keeps a worker process alive; this part only moves requests:
`admit` checks one against the model's limits and the waiting limit (--max-queue), `pump`
sends it down as soon as a worker serves, `cancel` drops a queued request or tells the
worker, and the request events the worker sends (Started, Delta, Done, Error with a rid)
are routed to their handles. When a worker ends, `on_worker_gone` fails what had started
(retryable) and puts the rest back in the queue for the next one.

Requests go to the worker on arrival, not when a slot frees: its preparation thread
renders and tokenizes them in arrival order while others decode, so a prompt that cannot
fit gets its 400 at once, even behind a long generation, and the next request starts
without waiting for its template, tokens or grammar. The worker runs `slots` of them at a
time and holds the rest prepared. The queue here holds requests only while no worker
serves (loading, restarting). What waits, here or on the worker, counts against
--max-queue, so the limit still means what it says.

Anything that fails between admission and the worker's `Started` (encoding, sending) fails
that request alone and frees its slot at once: it is never re-queued, since it would fail
the same way on any worker.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

import msgspec

from protocol import (Audio, Cancel, Delta, Done, Error, FinishReason, Generate, ModelKind,
                      Pooled, Started, Tokens, Transcript)
from supervisor.config import Config
from supervisor.workers.errors import Overloaded, WorkerError, WorkerFailed, from_worker
from supervisor.workers.handle import QUEUED, STARTED, RequestHandle
from supervisor.workers.limits import check_limits, check_task, unsendable
from supervisor.workers.link import LinkClosed, WorkerLink

log = logging.getLogger("mlxd.runner")


class Dispatcher:
    def __init__(self, model_id: str, config: Config, clock: Callable[[], float],
                 steps: Callable[[], int] = lambda: 0):
        self.model_id = model_id
        self.config = config
        self._clock = clock
        self._steps = steps  # the worker's step count as last heard: stamped on a cancel
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.inflight: dict[str, RequestHandle] = {}
        self.slots = 1
        self.epoch = 0
        self.link: WorkerLink | None = None  # the worker requests go to, while it serves
        self.busy_since = 0.0  # when the worker was last given work while it had none
        self.context_length: int | None = None
        self.vocab_size: int | None = None
        self.model_kind: ModelKind | None = None  # known once a worker was ready

    # ---- admission -----------------------------------------------------------------------
    def admit(self, request: Generate, params: dict) -> RequestHandle:
        """Check the request against the model's limits and queue it."""
        check_task(self.model_id, request.task, self.model_kind)
        check_limits(request.sampling, params, self.context_length, self.vocab_size)
        if self.waiting() >= self.config.max_queue:
            raise Overloaded(
                f"Too many requests are waiting for model `{self.model_id}`; please retry.", 1)
        h = RequestHandle(self.model_id, request, on_cancel=self.cancel)
        self.queue.append(h)
        self.pump()
        return h

    def adopt(self, h: RequestHandle) -> None:
        """Take over a request another runner of this model never started."""
        h.rebind(self.cancel)
        self.queue.append(h)
        self.pump()

    def is_idle(self) -> bool:
        return not self.queue and not self.inflight

    def waiting(self) -> int:
        """Requests accepted and not started: queued here or held by the worker. One
        whose cancel was sent no longer counts: the worker drops it at its next step."""
        return len(self.queue) + sum(1 for h in self.inflight.values()
                                     if h.state != STARTED and not h.finished
                                     and h.cancel_sent_at is None)

    # ---- to the worker ------------------------------------------------------------------
    def serve(self, link: WorkerLink | None) -> None:
        """The worker requests go to from now on (None: none takes requests)."""
        self.link = link
        self.pump()

    def pump(self) -> None:
        """Send every queued request to the serving worker (see the module docstring)."""
        link = self.link
        if link is None:
            return
        while self.queue:
            h = self.queue.popleft()
            if not self.inflight:
                self.busy_since = self._clock()  # the hang clock starts with the work
            rid = h.new_attempt()
            self.inflight[rid] = h
            try:
                # The surface built the whole request; each attempt only gets its rid.
                link.send(msgspec.structs.replace(h.request, rid=rid,
                                                  log_prompt=self.config.log_prompts))
            except LinkClosed:
                return  # the exit handler re-queues it
            except Exception as e:
                self.inflight.pop(rid, None)
                h.fail(unsendable(e))

    def cancel(self, h: RequestHandle) -> None:
        if h.state == QUEUED:
            try:
                self.queue.remove(h)
            except ValueError:
                pass
            h.on_done(Done(epoch=self.epoch, rid=h.rid or "",
                           finish_reason=FinishReason.CANCELLED))
        else:
            self.send_cancel(h)
        self.pump()

    def send_cancel(self, h: RequestHandle) -> None:
        if h.rid is None or h.cancel_sent_at is not None or self.link is None:
            return
        h.cancel_sent_at, h.cancel_sent_steps = self._clock(), self._steps()
        try:
            self.link.send(Cancel(rid=h.rid))
        except LinkClosed:
            pass

    # ---- from the worker ----------------------------------------------------------------
    def on_started(self, msg: Started) -> None:
        h = self.inflight.get(msg.rid)
        if h is not None:
            h.on_started(msg)

    def on_delta(self, msg: Delta | Audio) -> None:
        h = self.inflight.get(msg.rid)
        if h is not None and not h.on_delta(msg):
            h.set_failure(Overloaded(
                "The client read the stream too slowly; the request was cancelled.", 1))
            self.send_cancel(h)

    def on_result(self, msg: Tokens | Pooled | Transcript) -> None:
        h = self.inflight.get(msg.rid)
        if h is not None:
            h.on_result(msg)

    def on_done(self, msg: Done) -> RequestHandle | None:
        """The request's end; returns its handle (None for an unknown rid)."""
        h = self.inflight.pop(msg.rid, None)
        if h is not None:
            h.on_done(msg)
        self.pump()
        return h

    def on_error(self, msg: Error) -> None:
        h = self.inflight.get(msg.rid)
        if h is not None:
            h.set_failure(from_worker(msg.code, msg.message, msg.param))

    # ---- endings ------------------------------------------------------------------------
    def on_worker_gone(self, cause: str) -> None:
        """Requests on the dead worker: started ones fail (retryable), others re-queue."""
        self.link = None
        requeue = []
        for h in self.inflight.values():
            if h.finished:
                continue
            if h.cancel_requested:
                h.fail(WorkerFailed("The request was cancelled."))
            elif h.state == STARTED:
                doing = "generating" if h.first_token_at else "reading the prompt"
                h.fail(WorkerFailed(
                    f"The model worker stopped while {doing} ({cause}); please retry."))
            else:
                h.requeue()
                requeue.append(h)
        self.inflight.clear()
        self.queue.extendleft(reversed(requeue))

    def fail_queued(self, error: WorkerError) -> None:
        for h in list(self.queue):
            h.fail(error)
        self.queue.clear()

    def take_queued(self) -> list[RequestHandle]:
        """The queue's requests that never finished, handed over (the queue empties)."""
        out = [h for h in self.queue if not h.finished]
        self.queue.clear()
        return out

    def cancel_running(self, error: WorkerError) -> None:
        """Record `error` on every running request and ask the worker to cancel it."""
        for h in list(self.inflight.values()):
            h.set_failure(error)
            self.send_cancel(h)

    def fail_running(self, error: WorkerError, *, started_only: bool = False) -> int:
        """End running requests now with `error`; returns how many ended."""
        ended = 0
        for h in list(self.inflight.values()):
            if not h.finished and (not started_only or h.state == STARTED):
                h.fail(error)
                ended += 1
        return ended
