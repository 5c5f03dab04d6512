"""One model's worker, kept alive: admission queue, dispatch, liveness, restarts.

The runner owns a single worker incarnation at a time (a `WorkerLink`), made by an
injected `link_factory(epoch)`: the real one spawns `python -m worker`, tests pass an
in-process fake. Liveness has three signals (DESIGN.md): process exit (authoritative,
noticed at once through `link.wait()`), heartbeats, and step progress while busy.
Requests not yet started when a worker dies are re-queued on the next incarnation;
started ones fail with a retryable 503. Crash restarts back off exponentially and a
crash loop marks the model broken.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

from protocol import (Cancel, Delta, Done, Error, Generate, Heartbeat, Ready, Shutdown,
                      Started, Status, StatusRequest)
from supervisor.config import Config
from supervisor.errors import APIError
from supervisor.link import LinkClosed, LinkFactory, WorkerLink
from supervisor.requests import QUEUED, STARTED, RequestHandle

log = logging.getLogger("mlxd.runner")

# Runner states, as /health shows them.
STARTING, READY, RESTARTING, BROKEN, STOPPED = "starting", "ready", "restarting", "broken", "stopped"


@dataclass
class Liveness:
    """What the last heartbeat said, and when step progress was last seen."""
    heartbeat_at: float = 0.0
    steps: int = 0
    steps_changed_at: float = 0.0
    worker_state: str = "starting"
    active: int = 0
    waiting: int = 0
    active_bytes: int = 0
    peak_bytes: int = 0


class ModelRunner:
    MONITOR_INTERVAL = 0.25

    def __init__(self, model_id: str, config: Config, link_factory: LinkFactory, *,
                 clock=time.monotonic):
        self.id = model_id
        self.config = config
        self._factory = link_factory
        self._clock = clock
        self.state = STOPPED
        self.link: WorkerLink | None = None
        self.epoch = 0
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.inflight: dict[str, RequestHandle] = {}
        self.slots = 1
        self.context_length: int | None = None
        self.random_weights = False
        self.ready_at: float | None = None
        self.restarts = 0
        self.restart_causes: collections.Counter = collections.Counter()
        self.last_error: str | None = None
        self.live = Liveness()
        self._crashes: collections.deque[float] = collections.deque()
        self._kill_reason: str | None = None
        self._load_error: str | None = None
        self._stopping = False
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._status_waiters: dict[int, asyncio.Future] = {}
        self._qid = 0

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._supervise(), name=f"runner:{self.id}")

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def begin_shutdown(self) -> None:
        """Refuse new requests, end queued ones and cancel running ones, each with a
        retryable "shutting down" error; the worker keeps running until `stop`."""
        self._stopping = True
        shutting_down = APIError.worker_failed("The server is shutting down.")
        for h in list(self.queue):
            h.fail(shutting_down)
        self.queue.clear()
        for h in list(self.inflight.values()):
            h.set_failure(shutting_down)
            self._send_cancel(h)

    async def stop(self, grace: float | None = None) -> None:
        """Cancel everything, ask the worker to exit, kill it after `grace`."""
        grace = self.config.cancel_grace if grace is None else grace
        self.begin_shutdown()
        link = self.link
        if link is not None and self._task is not None and not self._task.done():
            try:
                link.send(Shutdown())
            except LinkClosed:
                pass
            link.terminate()
            done, _ = await asyncio.wait({self._task}, timeout=grace)
            if not done:
                link.kill()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self.state = STOPPED

    async def _supervise(self) -> None:
        backoff = self.config.restart_backoff
        while not self._stopping:
            self.epoch += 1
            link = self._factory(self.epoch)
            self.link = link
            self.state = STARTING if self.restarts == 0 else RESTARTING
            self._kill_reason = self._load_error = None
            now = self._clock()
            self.live = Liveness(heartbeat_at=now, steps_changed_at=now)
            try:
                await link.start()
            except Exception as e:  # could not even spawn: count as a crash
                log.error("model %s: could not start a worker: %s", self.id, e)
                code, cause = None, f"spawn failed: {e}"
            else:
                log.info("model %s: worker epoch %d started (pid %s)", self.id, self.epoch, link.pid)
                reader = asyncio.create_task(self._read(link))
                monitor = asyncio.create_task(self._monitor(link))
                code = await link.wait()
                monitor.cancel()
                reader.cancel()
                await asyncio.gather(reader, monitor, return_exceptions=True)
                await self._drain(link)
                cause = self._kill_reason or self._load_error or f"exited with code {code}"
            link.close()
            was_ready_for = (self._clock() - self.ready_at) if self.ready_at else 0.0
            self._ready.clear()
            self.ready_at = None
            self._on_worker_gone(cause)
            if self._stopping:
                break
            tail = link.stderr_tail()[-3:]
            self.last_error = cause + (f" ({' | '.join(tail)})" if tail and not self._load_error else "")
            log.warning("model %s: worker epoch %d gone: %s", self.id, self.epoch, self.last_error)
            if self._load_error is not None:
                self._mark_broken(f"failed to load: {self._load_error}")
                return
            self.restarts += 1
            self.restart_causes[self._cause_kind(cause)] += 1
            now = self._clock()
            self._crashes.append(now)
            while self._crashes and now - self._crashes[0] > self.config.crash_window:
                self._crashes.popleft()
            if len(self._crashes) > self.config.crash_budget:
                self._mark_broken(f"crash loop: {len(self._crashes)} crashes within "
                                  f"{self.config.crash_window:g} s; last: {self.last_error}")
                return
            if was_ready_for > self.config.crash_window:
                backoff = self.config.restart_backoff
            self.state = RESTARTING
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.restart_backoff_max)
        self.state = STOPPED

    @staticmethod
    def _cause_kind(cause: str) -> str:
        for kind in ("heartbeat", "hung", "cancel", "killed", "spawn"):
            if kind in cause:
                return kind
        return "crash"

    def _mark_broken(self, reason: str) -> None:
        self.state = BROKEN
        self.last_error = reason
        log.error("model %s is broken: %s", self.id, reason)
        for h in list(self.queue):
            h.fail(self._unavailable())
        self.queue.clear()

    def _unavailable(self) -> APIError:
        return APIError.worker_failed(f"Model `{self.id}` is unavailable: {self.last_error}")

    def _on_worker_gone(self, cause: str) -> None:
        """Requests on the dead worker: started ones fail (retryable), others re-queue."""
        requeue = []
        for h in self.inflight.values():
            if h.finished:
                continue
            if h.cancel_requested:
                h.fail(APIError.worker_failed("The request was cancelled."))
            elif h.state == STARTED:
                h.fail(APIError.worker_failed(
                    f"The model worker stopped while generating ({cause}); please retry."))
            else:
                h.requeue()
                requeue.append(h)
        self.inflight.clear()
        self.queue.extendleft(reversed(requeue))
        for fut in self._status_waiters.values():
            if not fut.done():
                fut.set_exception(APIError.worker_failed("The worker stopped."))
        self._status_waiters.clear()

    # ---- events ----------------------------------------------------------------------
    async def _read(self, link: WorkerLink) -> None:
        try:
            while True:
                for msg in await link.recv():
                    if getattr(msg, "epoch", None) == link.epoch:  # else a dead incarnation's
                        self._on_event(link, msg)
        except LinkClosed:
            pass

    async def _drain(self, link: WorkerLink) -> None:
        """Events a worker sent just before it exited (its last Done) may still sit in
        the socket: take them before judging what the death interrupted."""
        while True:
            try:
                msgs = await asyncio.wait_for(link.recv(), 0.05)
            except (asyncio.TimeoutError, LinkClosed):
                return
            for msg in msgs:
                if getattr(msg, "epoch", None) == link.epoch:
                    self._on_event(link, msg)

    def _on_event(self, link: WorkerLink, msg) -> None:
        if isinstance(msg, Delta):
            h = self.inflight.get(msg.rid)
            self._progress()
            if h is not None and not h.on_delta(msg):
                h.set_failure(APIError.overloaded(
                    "The client read the stream too slowly; the request was cancelled.", 1))
                self._send_cancel(h)
        elif isinstance(msg, Done):
            h = self.inflight.pop(msg.rid, None)
            if h is not None:
                h.on_done(msg)
            self._pump()
        elif isinstance(msg, Started):
            h = self.inflight.get(msg.rid)
            self._progress()
            if h is not None:
                h.on_started(msg)
        elif isinstance(msg, Heartbeat):
            lv = self.live
            lv.heartbeat_at = self._clock()
            if msg.steps != lv.steps:
                lv.steps, lv.steps_changed_at = msg.steps, lv.heartbeat_at
            lv.worker_state, lv.active, lv.waiting = msg.state, msg.active, msg.waiting
            lv.active_bytes, lv.peak_bytes = msg.active_bytes, msg.peak_bytes
        elif isinstance(msg, Ready):
            self.state = READY
            self.slots = max(1, msg.slots)
            self.context_length = msg.context_length
            self.random_weights = msg.random_weights
            self.ready_at = self._clock()
            self.live.active_bytes, self.live.peak_bytes = msg.active_bytes, msg.peak_bytes
            self._ready.set()
            log.info("model %s ready (context %d tokens%s)", self.id, msg.context_length,
                     "; RANDOM WEIGHTS, output is meaningless" if msg.random_weights else "")
            self._pump()
        elif isinstance(msg, Error):
            if msg.rid is None:
                self._load_error = msg.message
            elif (h := self.inflight.get(msg.rid)) is not None:
                h.set_failure(APIError.from_worker(msg.code, msg.message, msg.param))
        elif isinstance(msg, Status):
            fut = self._status_waiters.pop(msg.qid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _progress(self) -> None:
        self.live.steps_changed_at = self._clock()

    async def _monitor(self, link: WorkerLink) -> None:
        """Kill a worker that stopped beating, stopped making progress while busy, or
        left a cancel unanswered past the grace period. The exit does the rest."""
        cfg = self.config
        while True:
            await asyncio.sleep(self.MONITOR_INTERVAL)
            now = self._clock()
            reason = None
            if now - self.live.heartbeat_at > cfg.heartbeat_timeout:
                reason = f"no heartbeat for {cfg.heartbeat_timeout:g} s"
            elif (self.inflight and self.state == READY
                  and now - self.live.steps_changed_at > cfg.hang_timeout):
                reason = f"hung: busy with no progress for {cfg.hang_timeout:g} s"
            else:
                for h in self.inflight.values():
                    if h.cancel_sent_at is not None and now - h.cancel_sent_at > cfg.cancel_grace:
                        reason = f"cancel unanswered for {cfg.cancel_grace:g} s"
                        break
            if reason:
                log.warning("model %s: killing worker pid %s: %s", self.id, link.pid, reason)
                self._kill_reason = "killed: " + reason
                link.kill()
                return

    # ---- requests --------------------------------------------------------------------
    def submit(self, fields: dict) -> RequestHandle:
        if self.state == BROKEN:
            raise self._unavailable()
        if self._stopping:
            raise APIError.worker_failed("The server is shutting down.")
        if len(self.queue) >= self.config.max_queue:
            raise APIError.overloaded(
                f"Too many requests are waiting for model `{self.id}`; please retry.", 1)
        h = RequestHandle(self.id, fields, on_cancel=self._cancel)
        self.queue.append(h)
        self._pump()
        return h

    def _pump(self) -> None:
        """Dispatch queued requests while the worker has free slots. A request whose
        cancel was sent no longer holds a slot: the worker applies cancels before it
        starts the next request, so the next one may go down at once."""
        link = self.link
        if self.state != READY or link is None:
            return
        busy = sum(1 for h in self.inflight.values() if h.cancel_sent_at is None)
        while self.queue and busy < self.slots:
            h = self.queue.popleft()
            rid = h.new_attempt()
            self.inflight[rid] = h
            try:
                link.send(Generate(rid=rid, log_prompt=self.config.log_prompts, **h.fields))
            except LinkClosed:
                return  # the exit handler re-queues it
            busy += 1

    def _cancel(self, h: RequestHandle) -> None:
        if h.state == QUEUED:
            try:
                self.queue.remove(h)
            except ValueError:
                pass
            h.on_done(Done(epoch=self.epoch, rid=h.rid or "", finish_reason="cancelled"))
        else:
            self._send_cancel(h)
        self._pump()

    def _send_cancel(self, h: RequestHandle) -> None:
        if h.rid is None or h.cancel_sent_at is not None or self.link is None:
            return
        h.cancel_sent_at = self._clock()
        try:
            self.link.send(Cancel(rid=h.rid))
        except LinkClosed:
            pass

    async def worker_status(self, timeout: float = 2.0) -> Status:
        if self.link is None or self.state != READY:
            raise self._unavailable() if self.state == BROKEN else APIError.worker_failed(
                f"Model `{self.id}` is {self.state}.")
        self._qid += 1
        fut = asyncio.get_running_loop().create_future()
        self._status_waiters[self._qid] = fut
        self.link.send(StatusRequest(qid=self._qid))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._status_waiters.pop(self._qid, None)

    def kill(self, reason: str = "killed by admin") -> None:
        if self.link is not None:
            self._kill_reason = reason
            self.link.kill()

    def snapshot(self) -> dict:
        """State for /health and status: cached, never asks the worker."""
        lv = self.live
        return {
            "model": self.id, "state": self.state, "epoch": self.epoch,
            "pid": self.link.pid if self.link else None,
            "context_length": self.context_length, "random_weights": self.random_weights,
            "queued": len(self.queue), "in_flight": len(self.inflight),
            "worker_active": lv.active, "worker_waiting": lv.waiting, "steps": lv.steps,
            "active_bytes": lv.active_bytes, "peak_bytes": lv.peak_bytes,
            "restarts": self.restarts, "restart_causes": dict(self.restart_causes),
            "last_error": self.last_error,
            "uptime_s": round(self._clock() - self.ready_at, 1) if self.ready_at else None,
        }
