"""One model's worker, kept alive: admission queue, dispatch, liveness, restarts.

The runner owns a single worker incarnation at a time (a `WorkerLink`), made by an
injected `link_factory(epoch)`: the real one spawns `python -m worker`, tests pass an
in-process fake. Liveness has three signals (DESIGN.md): process exit (authoritative,
noticed at once through `link.wait()`), heartbeats, and step progress while busy.
Requests not yet started when a worker dies are re-queued on the next incarnation;
started ones fail with a retryable 503. Crash restarts back off exponentially and a
crash loop marks the model broken.

Before its first worker spawns, the runner waits on the pool's memory gate (`admit`); a
refusal ends it, failing what was queued with the gate's 507. Leaving service is
`retire`: drain (serve what was accepted, then stop) or force (fail what runs, kill);
requests that never reached a worker are handed back for the pool to route again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Awaitable, Callable

from protocol import (Cancel, Delta, Done, Error, Generate, Heartbeat, Ready, Shutdown,
                      Started, Status, StatusRequest)
from supervisor.config import Config
from supervisor.workers.limits import check_limits, unsendable
from supervisor.http.errors import APIError
from supervisor.workers.link import LinkClosed, LinkFactory, WorkerLink
from supervisor.workers.liveness import Liveness
from supervisor.workers.observer import Observer
from supervisor.workers.handle import QUEUED, STARTED, RequestHandle
from supervisor.workers.throughput import TokenRate

log = logging.getLogger("mlxd.runner")

# Runner states, as /health shows them. WAITING: for the memory gate, before the first
# spawn. DRAINING: retiring, serving what it had accepted before it stops.
STARTING, READY, RESTARTING, BROKEN, STOPPED = "starting", "ready", "restarting", "broken", "stopped"
WAITING, DRAINING = "waiting", "draining"
DRAIN, FORCE = "drain", "force"


Admit = Callable[["ModelRunner"], Awaitable[None]]


class ModelRunner:
    MONITOR_INTERVAL = 0.25

    def __init__(self, model_id: str, config: Config, link_factory: LinkFactory, *,
                 clock=time.monotonic, admit: Admit | None = None,
                 observer: Observer | None = None,
                 on_refused: Callable[["ModelRunner"], None] | None = None):
        self.id = model_id
        self.config = config
        self._factory = link_factory
        self._clock = clock
        self._admit = admit
        self._on_refused = on_refused
        self.observer = observer or Observer()
        self.state = STOPPED
        self.pinned = False              # never unloaded for keep-alive (--model, swaps, loads)
        self.need_bytes = 0              # the memory gate's estimate, once admitted
        self.last_used = clock()         # for LRU eviction and keep-alive
        self.tokens = TokenRate()        # completion tokens, for tokens/s over a minute
        self.refused: APIError | None = None
        self.link: WorkerLink | None = None
        self.epoch = 0
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.inflight: dict[str, RequestHandle] = {}
        self.slots = 1
        self.context_length: int | None = None
        self.vocab_size: int | None = None   # from Ready; 0/None: not reported
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
        self._retiring = False           # out of the pool: accept nothing new
        self._draining = False           # server shutdown: accept nothing new, finish the rest
        self._admin_kill = False
        self._worker_alive = False       # a worker process may exist right now
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._status_waiters: dict[int, asyncio.Future] = {}
        self._qid = 0

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self.state = WAITING if self._admit is not None else STARTING
        self._task = asyncio.create_task(self._supervise(), name=f"runner:{self.id}")

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_loaded(self) -> None:
        """Until a worker is ready or the runner has ended (refused, broken, stopped)."""
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()

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
        await self._end_worker(grace)
        shutting_down = APIError.worker_failed("The server is shutting down.")
        for h in list(self.queue):  # dispatched ones the exit put back
            h.fail(shutting_down)
        self.queue.clear()
        self.state = STOPPED

    async def _end_worker(self, grace: float) -> None:
        """Ask the worker to exit (Shutdown, SIGTERM), SIGKILL it after `grace`, and wait
        for the supervise task. With no worker alive (waiting for memory, or sleeping
        before a restart) there is nothing to stop: the task is cancelled."""
        task = self._task
        if task is None or task.done():
            return
        self._stopping = True
        link = self.link
        if self._worker_alive and link is not None:
            try:
                link.send(Shutdown())
            except LinkClosed:
                pass
            link.terminate()
            await asyncio.wait({task}, timeout=grace)
        while not task.done():
            if self._worker_alive and self.link is not None:
                self.link.kill()
            else:
                task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        await asyncio.gather(task, return_exceptions=True)

    def is_idle(self) -> bool:
        return not self.queue and not self.inflight

    @property
    def evictable(self) -> bool:
        """Idle and loaded (or broken): unloading it interrupts nothing."""
        return self.is_idle() and self.state in (READY, BROKEN) and not self._retiring

    async def wait_idle(self, timeout: float) -> bool:
        """Until nothing is queued or running (True), or `timeout` passes (False)."""
        deadline = self._clock() + timeout
        while not self.is_idle():
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def begin_drain(self) -> None:
        """Server shutdown, first phase: refuse new requests, keep serving the others."""
        self._draining = True

    async def retire(self, mode: str, *, timeout: float, reason: str) -> list[RequestHandle]:
        """Leave service. `drain`: serve what is running and queued (up to `timeout`),
        then stop the worker; `force`: fail what has started, SIGKILL the worker.
        Returns the requests that never started, for the pool to route again."""
        self._retiring = True
        if self.state == READY:
            self.state = DRAINING
        gone = APIError.worker_failed(
            f"The model `{self.id}` was unloaded ({reason}) while this request ran; please retry.")
        if mode == DRAIN and not await self.wait_idle(timeout):
            log.warning("model %s: drain timed out after %g s; cancelling %d request(s)",
                        self.id, timeout, len(self.inflight))
        leftovers = list(self.queue)
        self.queue.clear()
        self._stopping = True
        for h in list(self.inflight.values()):
            if mode == FORCE and h.state == STARTED:
                h.fail(gone)
            elif mode == DRAIN:
                h.set_failure(gone)
                self._send_cancel(h)
        # Force, or nothing left on the worker: SIGKILL at once. An idle worker has no
        # request to answer, exit is what frees its memory either way, and a cooperative
        # exit (threads, sockets, interpreter teardown) costs a swap ~0.3 s for nothing.
        if (mode == FORCE or not self.inflight) and self._worker_alive and self.link is not None:
            self._kill_reason = f"killed: {reason}"
            self.link.kill()
        await self._end_worker(self.config.cancel_grace)
        leftovers += [h for h in self.queue if not h.finished]  # dispatched, never started
        self.queue.clear()
        self.state = STOPPED
        log.info("model %s unloaded (%s, %s)", self.id, mode, reason)
        return leftovers

    async def _supervise(self) -> None:
        if self._admit is not None and not await self._pass_gate():
            return
        backoff = self.config.restart_backoff
        while not self._stopping:
            self.epoch += 1
            link = self._factory(self.epoch)
            self.link = link
            self.state = STARTING if self.restarts == 0 else RESTARTING
            self._kill_reason = self._load_error = None
            now = self._clock()
            self.live = Liveness(heartbeat_at=now, steps_changed_at=now)
            self._worker_alive = True
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
            self._worker_alive = False
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
            if self._admin_kill:  # mlxctl kill: respawn at once, not a crash
                self._admin_kill = False
                self.restart_causes["admin"] += 1
                self.observer.worker_restarted(self, "admin")
                continue
            kind = self._cause_kind(cause)
            self.restart_causes[kind] += 1
            self.observer.worker_restarted(self, kind)
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

    async def _pass_gate(self) -> bool:
        """Wait for the memory gate. A refusal (507, or too many busy models) ends the
        runner: what was queued gets the refusal, and the pool forgets the model."""
        self.state = WAITING
        try:
            await self._admit(self)
        except Exception as e:
            if not isinstance(e, APIError):
                log.exception("model %s: the memory gate failed", self.id)
                e = APIError.internal()
            self.refused = e
            self.last_error = e.message
            self.state = STOPPED
            log.warning("model %s not loaded: %s", self.id, e.message)
            for h in list(self.queue):
                h.fail(e)
            self.queue.clear()
            if self._on_refused is not None:
                self._on_refused(self)
            return False
        return True

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
                        self._on_event_safely(link, msg)
        except LinkClosed:
            pass

    def _on_event_safely(self, link: WorkerLink, msg) -> None:
        """A bug in handling one event must not end the reader: a dead reader reads no
        heartbeats, and the monitor would then kill every healthy worker as silent."""
        try:
            self._on_event(link, msg)
        except Exception:
            log.exception("model %s: handling a %s event failed", self.id, msg.kind)

    async def _drain(self, link: WorkerLink) -> None:
        """Events a worker sent just before it exited (its last Done) may still sit in
        the socket: take them before judging what the death interrupted. With nothing
        in flight there is nothing to judge: no need to wait for stragglers."""
        while self.inflight or self._status_waiters:
            try:
                msgs = await asyncio.wait_for(link.recv(), 0.05)
            except (asyncio.TimeoutError, LinkClosed):
                return
            for msg in msgs:
                if getattr(msg, "epoch", None) == link.epoch:
                    self._on_event_safely(link, msg)

    def _on_event(self, link: WorkerLink, msg) -> None:
        if isinstance(msg, Delta):
            h = self.inflight.get(msg.rid)
            now = self._clock()
            self.live.steps_changed_at = now
            self.tokens.add(len(msg.token_ids) >> 2, now)  # packed uint32 ids
            if h is not None and not h.on_delta(msg):
                h.set_failure(APIError.overloaded(
                    "The client read the stream too slowly; the request was cancelled.", 1))
                self._send_cancel(h)
        elif isinstance(msg, Done):
            h = self.inflight.pop(msg.rid, None)
            if h is not None:
                h.on_done(msg)
                self.last_used = self._clock()
                self.observer.request_done(self, h, msg)
            self._pump()
        elif isinstance(msg, Started):
            h = self.inflight.get(msg.rid)
            self.live.steps_changed_at = self._clock()  # prefill began: progress
            if h is not None:
                h.on_started(msg)
        elif isinstance(msg, Heartbeat):
            self.live.on_heartbeat(msg, self._clock())
        elif isinstance(msg, Ready):
            self.state = DRAINING if self._retiring else READY
            self.slots = max(1, msg.slots)
            self.context_length = msg.context_length
            self.vocab_size = msg.vocab_size or None
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

    async def _monitor(self, link: WorkerLink) -> None:
        """Kill a worker that stopped beating, stopped making progress while busy, or
        left a cancel unanswered past the grace period. The exit does the rest."""
        while True:
            await asyncio.sleep(self.MONITOR_INTERVAL)
            reason = self.live.verdict(
                self._clock(), self.config,
                busy=bool(self.inflight) and self.state in (READY, DRAINING),
                cancels_sent_at=[h.cancel_sent_at for h in self.inflight.values()])
            if reason:
                log.warning("model %s: killing worker pid %s: %s", self.id, link.pid, reason)
                self._kill_reason = "killed: " + reason
                link.kill()
                return

    # ---- requests --------------------------------------------------------------------
    def submit(self, fields: dict, params: dict | None = None) -> RequestHandle:
        """Queue a request (Generate's fields, less rid). `params` maps a field to the
        name the client's API gave it, for error messages (Responses: max_output_tokens)."""
        check_limits(fields, params or {}, self.context_length, self.vocab_size)
        if self.state == BROKEN:
            raise self._unavailable()
        if self._stopping or self._draining:
            raise APIError.worker_failed("The server is shutting down.")
        if self._retiring:
            raise APIError.worker_failed(f"Model `{self.id}` is being unloaded; please retry.")
        if len(self.queue) >= self.config.max_queue:
            raise APIError.overloaded(
                f"Too many requests are waiting for model `{self.id}`; please retry.", 1)
        h = RequestHandle(self.id, fields, on_cancel=self._cancel)
        self.queue.append(h)
        self.last_used = self._clock()
        self._pump()
        return h

    def adopt(self, h: RequestHandle) -> None:
        """Take over a request that another runner of this model never started (it was
        retired): it joins the queue and cancels through this runner from now on."""
        h.rebind(self._cancel)
        self.queue.append(h)
        self.last_used = self._clock()
        self._pump()

    def _pump(self) -> None:
        """Dispatch queued requests while the worker has free slots. A request whose
        cancel was sent no longer holds a slot: the worker applies cancels before it
        starts the next request, so the next one may go down at once."""
        link = self.link
        if self.state not in (READY, DRAINING) or link is None:
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
            except Exception as e:
                # Nothing reached the worker: this request fails alone, now, and gives
                # its slot back. Never re-queued: it would fail the same way on any worker.
                self.inflight.pop(rid, None)
                h.fail(unsendable(e))
                continue
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
        if self.link is None or self.state not in (READY, DRAINING):
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

    def kill(self, reason: str = "killed by mlxctl kill") -> int:
        """Hard-cancel everything on the worker: what it runs ends with a retryable
        error, the process is SIGKILLed and respawned at once (not counted as a crash);
        requests still queued here wait for the new worker. Returns how many ended."""
        err = APIError.worker_failed(f"The request was cancelled: the worker was {reason}.")
        ended = 0
        for h in list(self.inflight.values()):
            if not h.finished:
                h.fail(err)
                ended += 1
        if self.link is not None and self._worker_alive:
            self._kill_reason = reason
            self._admin_kill = True
            self.link.kill()
        return ended

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
            "pinned": self.pinned, "need_bytes": self.need_bytes,
            "idle_s": round(self._clock() - self.last_used, 1) if self.is_idle() else 0.0,
            "tokens_per_s": round(self.tokens.per_second(self._clock(), self.ready_at), 2),
            # Prompt-prefix caching is not reported by workers yet (DESIGN.md: worker/cache).
            "cached_prompts": 0,
        }

