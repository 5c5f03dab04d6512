"""One model's worker, kept alive: spawn, liveness, restarts, kill, and retirement.

The runner owns a single worker incarnation at a time (a `WorkerLink`), made by an
injected `link_factory(epoch)`: the real one spawns `python -m worker`, tests pass an
in-process fake. Liveness has three signals (DESIGN.md): process exit (authoritative,
noticed at once through `link.wait()`), heartbeats, and step progress while busy.
Crash restarts back off and a crash loop marks the model broken (restarts.py). Requests
are the dispatcher's business (dispatch.py: queue, sending, cancels); the runner tells it
which worker serves, and when one is gone.

The runner's state is a `RunnerState` and moves only along the table in states.py; why a
worker ended is an `ExitCause` (the liveness verdicts carry one), which keys the restart
counters and the metrics.

Before its first worker spawns, the runner waits on the pool's memory gate (`admit`); a
refusal ends it, failing what was queued with the gate's refusal. Leaving service is
`retire`: drain (serve what was accepted, then stop) or force (fail what runs, kill);
requests that never reached a worker are handed back for the pool to route again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Awaitable, Callable

import msgspec

from protocol import (Audio, CacheCommand, CacheReply, Delta, Done, Error, Generate, Heartbeat,
                      Pooled, Ready, Shutdown, Started, Status, StatusRequest, Tokens,
                      Transcript)
from supervisor.config import Config
from supervisor.workers.dispatch import Dispatcher
from supervisor.workers.errors import Internal, WorkerError, WorkerFailed
from supervisor.workers.handle import RequestHandle
from supervisor.workers.link import LinkClosed, LinkFactory, WorkerLink
from supervisor.workers.liveness import Liveness
from supervisor.workers.observer import Observer
from supervisor.workers.queries import Queries
from supervisor.workers.restarts import Restarts
from supervisor.workers.states import (SERVING, ExitCause, RunnerState, Verdict, check,
                                       exit_verdict)
from supervisor.workers.throughput import TokenRate

log = logging.getLogger("mlxd.runner")

# The states by their short names, for the pool, the metrics and the tests.
WAITING, STARTING, READY = RunnerState.WAITING, RunnerState.STARTING, RunnerState.READY
RESTARTING, DRAINING = RunnerState.RESTARTING, RunnerState.DRAINING
BROKEN, STOPPED = RunnerState.BROKEN, RunnerState.STOPPED
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
        self.clock = clock                # injected: tests drive time
        self._admit = admit
        self._on_refused = on_refused
        self.observer = observer or Observer()
        self._state = STOPPED
        self.dispatch = Dispatcher(model_id, config, clock, steps=lambda: self.live.steps)
        self.pinned = False              # never unloaded for keep-alive (--model, swaps, loads)
        self.need_bytes = 0              # the memory gate's estimate, once admitted
        self.last_used = clock()         # for LRU eviction and keep-alive
        self.tokens = TokenRate()        # completion tokens, for tokens/s over a minute
        self.refused: WorkerError | None = None
        self.link: WorkerLink | None = None
        self.epoch = 0
        self.random_weights = False
        self.dimensions: int | None = None  # an embedding model's vector width
        self.voices: list[str] = []         # a speech synthesis model's voices
        self.translates = False             # a speech recognition model that translates
        self.hears_audio = False            # a vision model that takes audio parts
        self.tokenizer: dict = {}           # its special tokens, chat template (Ready)
        self.group: dict | None = None      # a worker group's ranks and link (Ready.group)
        self.ready_at: float | None = None
        self.restart_log = Restarts(config)  # when an ended worker starts again, and counts
        self.last_error: str | None = None
        self.live = Liveness()
        self._verdict: Verdict | None = None   # why the current worker is being ended
        self._stopping = False
        self._retiring = False           # out of the pool: accept nothing new
        self._draining = False           # server shutdown: accept nothing new, finish the rest
        self._worker_alive = False       # a worker process may exist right now
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._queries = Queries()         # status and cache questions awaiting answers

    # ---- state -------------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        return self.restart_log.total

    @property
    def restart_causes(self) -> collections.Counter:  # ExitCause value -> n
        return self.restart_log.causes

    @property
    def state(self) -> RunnerState:
        return self._state

    def _to(self, new: RunnerState) -> None:
        self._state = check(self._state, new)
        self.dispatch.serve(self.link if new in SERVING and self._worker_alive else None)

    # What the dispatcher holds, as the pool, the metrics and /health read it.
    @property
    def queue(self):
        return self.dispatch.queue

    @property
    def inflight(self):
        return self.dispatch.inflight

    @property
    def slots(self) -> int:
        return self.dispatch.slots

    @property
    def context_length(self) -> int | None:
        return self.dispatch.context_length

    @property
    def kind(self) -> str | None:
        """text | vision | embed | rerank | stt | tts, once a worker was ready (None
        before)."""
        kind = self.dispatch.model_kind
        return kind.value if kind is not None else None

    @property
    def vocab_size(self) -> int | None:
        return self.dispatch.vocab_size

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._to(WAITING if self._admit is not None else STARTING)
        self._task = asyncio.create_task(self._supervise(), name=f"runner:{self.id}")

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_loaded(self, timeout: float | None = None) -> None:
        """Until a worker is ready or the runner has ended (refused, broken, stopped), or
        `timeout` seconds passed (the caller then finds it not ready)."""
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({ready, self._task}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()

    def begin_shutdown(self) -> None:
        """Refuse new requests, end queued ones and cancel running ones, each with a
        retryable "shutting down" error; the worker keeps running until `stop`."""
        self._stopping = True
        shutting_down = WorkerFailed("The server is shutting down.")
        self.dispatch.fail_queued(shutting_down)
        self.dispatch.cancel_running(shutting_down)

    async def stop(self, grace: float | None = None) -> None:
        """Cancel everything, ask the worker to exit, kill it after `grace`."""
        grace = self.config.cancel_grace if grace is None else grace
        self.begin_shutdown()
        await self._end_worker(grace)
        # Dispatched ones the exit put back:
        self.dispatch.fail_queued(WorkerFailed("The server is shutting down."))
        self._to(STOPPED)

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
        return self.dispatch.is_idle()

    @property
    def evictable(self) -> bool:
        """Idle and loaded (or broken): unloading it interrupts nothing."""
        return self.is_idle() and self.state in (READY, BROKEN) and not self._retiring

    async def wait_idle(self, timeout: float) -> bool:
        """Until nothing is queued or running (True), or `timeout` passes (False)."""
        deadline = self.clock() + timeout
        while not self.is_idle():
            if self.clock() >= deadline:
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
            self._to(DRAINING)
        gone = WorkerFailed(
            f"The model `{self.id}` was unloaded ({reason}) while this request ran; please retry.")
        if mode == DRAIN and not await self.wait_idle(timeout):
            log.warning("model %s: drain timed out after %g s; cancelling %d request(s)",
                        self.id, timeout, len(self.inflight))
        leftovers = self.dispatch.take_queued()
        self._stopping = True
        if mode == FORCE:
            self.dispatch.fail_running(gone, started_only=True)
        else:
            self.dispatch.cancel_running(gone)
        # Force, or nothing left on the worker: SIGKILL at once. An idle worker has no
        # request to answer, exit is what frees its memory either way, and a cooperative
        # exit (threads, sockets, interpreter teardown) costs a swap ~0.3 s for nothing.
        if (mode == FORCE or not self.inflight) and self._worker_alive and self.link is not None:
            self._verdict = Verdict(ExitCause.KILLED, f"killed: {reason}")
            self.link.kill()
        await self._end_worker(self.config.cancel_grace)
        leftovers += self.dispatch.take_queued()  # dispatched, never started
        self._to(STOPPED)
        log.info("model %s unloaded (%s, %s)", self.id, mode, reason)
        return leftovers

    # ---- supervision -----------------------------------------------------------------
    async def _supervise(self) -> None:
        if self._admit is not None and not await self._pass_gate():
            return
        while not self._stopping:
            self.epoch += 1
            self.dispatch.epoch = self.epoch
            link = self._factory(self.epoch)
            self.link = link
            self._verdict = None
            now = self.clock()
            self.live = Liveness(heartbeat_at=now, steps_changed_at=now)
            self._worker_alive = True
            self._to(STARTING if self.restarts == 0 else RESTARTING)
            try:
                await link.start()
            except Exception as e:  # could not even spawn: count as a crash
                log.error("model %s: could not start a worker: %s", self.id, e)
                ended = Verdict(ExitCause.SPAWN, f"spawn failed: {e}")
            else:
                log.info("model %s: worker epoch %d started (pid %s)", self.id, self.epoch, link.pid)
                reader = asyncio.create_task(self._read(link))
                monitor = asyncio.create_task(self._monitor(link))
                code = await link.wait()
                monitor.cancel()
                reader.cancel()
                await asyncio.gather(reader, monitor, return_exceptions=True)
                await self._drain(link)
                ended = self._verdict or exit_verdict(code)
            self._worker_alive = False
            link.close()
            was_ready_for = (self.clock() - self.ready_at) if self.ready_at else 0.0
            self._ready.clear()
            self.ready_at = None
            self.dispatch.on_worker_gone(ended.reason)
            self._queries.fail_all()
            if self._stopping:
                break
            tail = link.stderr_tail()[-3:]
            load_failed = ended.cause is ExitCause.LOAD
            self.last_error = ended.reason + (
                f" ({' | '.join(tail)})" if tail and not load_failed else "")
            log.warning("model %s: worker epoch %d gone: %s", self.id, self.epoch, self.last_error)
            if load_failed:
                self._mark_broken(ended.reason)
                return
            then = self.restart_log.after(ended.cause, self.clock(), was_ready_for,
                                          self.last_error)
            self.observer.worker_restarted(self.id, ended.cause.value)
            if then.broken:
                self._mark_broken(then.broken)
                return
            if then.crash:
                self._to(RESTARTING)
                await asyncio.sleep(then.delay)
        self._to(STOPPED)

    async def _pass_gate(self) -> bool:
        """Wait for the memory gate. A refusal (no memory, or too many busy models) ends
        the runner: what was queued gets the refusal, and the pool forgets the model."""
        try:
            await self._admit(self)
        except Exception as e:
            if not isinstance(e, WorkerError):
                log.exception("model %s: the memory gate failed", self.id)
                e = Internal()
            self.refused = e
            self.last_error = e.message
            self._to(STOPPED)
            log.warning("model %s not loaded: %s", self.id, e.message)
            self.dispatch.fail_queued(e)
            if self._on_refused is not None:
                self._on_refused(self)
            return False
        return True

    def _mark_broken(self, reason: str) -> None:
        self._to(BROKEN)
        self.last_error = reason
        log.error("model %s is broken: %s", self.id, reason)
        self.dispatch.fail_queued(self._unavailable())

    def _unavailable(self) -> WorkerError:
        return WorkerFailed(f"Model `{self.id}` is unavailable: {self.last_error}")

    def memory_limit(self) -> int | None:
        """MLX memory the worker may hold while idle before it is recycled:
        --worker-memory-limit, else what the memory gate reserved for it plus its prompt
        cache, with 25% headroom (None: neither is known)."""
        if self.config.worker_memory_limit:
            return self.config.worker_memory_limit
        if not self.need_bytes:
            return None
        return int((self.need_bytes + self.config.prompt_cache_bytes) * 1.25)

    async def _monitor(self, link: WorkerLink) -> None:
        """Kill a worker that stopped beating, stopped making progress while busy, or
        left a cancel unanswered past the grace period. The exit does the rest."""
        while True:
            await asyncio.sleep(self.MONITOR_INTERVAL)
            verdict = self.live.verdict(
                self.clock(), self.config,
                busy=bool(self.inflight) and self.state in SERVING,
                cancels=[(h.cancel_sent_at, h.cancel_sent_steps)
                         for h in self.inflight.values()],
                memory_limit=self.memory_limit() if self.state in SERVING else None,
                busy_since=self.dispatch.busy_since)
            if verdict is not None:
                log.warning("model %s: killing worker pid %s: %s", self.id, link.pid, verdict)
                self._verdict = Verdict(verdict.cause, "killed: " + verdict.reason)
                link.kill()
                return

    # ---- events ----------------------------------------------------------------------
    async def _read(self, link: WorkerLink) -> None:
        try:
            while True:
                for msg in await link.recv():
                    if getattr(msg, "epoch", None) == link.epoch:  # else a dead incarnation's
                        self._on_event_safely(link, msg)
        except LinkClosed:
            pass

    async def _drain(self, link: WorkerLink) -> None:
        """Events a worker sent just before it exited (its last Done) may still sit in
        the socket: take them before judging what the death interrupted. With nothing
        in flight there is nothing to judge: no need to wait for stragglers."""
        while self.inflight or self._queries:
            try:
                msgs = await asyncio.wait_for(link.recv(), 0.05)
            except (asyncio.TimeoutError, LinkClosed):
                return
            for msg in msgs:
                if getattr(msg, "epoch", None) == link.epoch:
                    self._on_event_safely(link, msg)

    def _on_event_safely(self, link: WorkerLink, msg) -> None:
        """A bug in handling one event must not end the reader: a dead reader reads no
        heartbeats, and the monitor would then kill every healthy worker as silent."""
        try:
            self._on_event(link, msg)
        except Exception:
            log.exception("model %s: handling a %s event failed", self.id, msg.kind)

    def _on_event(self, link: WorkerLink, msg) -> None:
        if isinstance(msg, Delta):
            now = self.clock()
            self.live.steps_changed_at = now
            self.tokens.add(msg.n_tokens, now)
            self.dispatch.on_delta(msg)
        elif isinstance(msg, Audio):  # speech as it is synthesised: streamed like Deltas
            self.live.steps_changed_at = self.clock()
            self.dispatch.on_delta(msg)
        elif isinstance(msg, (Tokens, Pooled, Transcript)):
            self.dispatch.on_result(msg)
        elif isinstance(msg, Done):
            h = self.dispatch.on_done(msg)
            if h is not None:
                self.last_used = self.clock()
                self.observer.request_done(self.id, h, msg)
        elif isinstance(msg, Started):
            self.live.steps_changed_at = self.clock()  # prefill began: progress
            self.dispatch.on_started(msg)
        elif isinstance(msg, Heartbeat):
            self.live.on_heartbeat(msg, self.clock())
        elif isinstance(msg, Ready):
            d = self.dispatch
            d.slots = max(1, msg.slots)
            d.context_length = msg.context_length
            d.vocab_size = msg.vocab_size or None
            d.model_kind = msg.model_kind
            self.dimensions = msg.dimensions or None
            self.voices, self.translates = list(msg.voices), msg.translates
            self.hears_audio = msg.hears_audio
            self.tokenizer = dict(msg.tokenizer)
            self.random_weights = msg.random_weights
            self.group = msgspec.to_builtins(msg.group) if msg.group is not None else None
            self.ready_at = self.clock()
            self.live.active_bytes, self.live.peak_bytes = msg.active_bytes, msg.peak_bytes
            self._to(DRAINING if self._retiring else READY)
            self._ready.set()
            log.info("model %s ready (context %d tokens%s)", self.id, msg.context_length,
                     "; RANDOM WEIGHTS, output is meaningless" if msg.random_weights else "")
        elif isinstance(msg, Error):
            if msg.rid is None:
                self._verdict = Verdict(ExitCause.LOAD, f"failed to load: {msg.message}")
            else:
                self.dispatch.on_error(msg)
        elif isinstance(msg, (Status, CacheReply)):  # answers to `_query`
            self._queries.answer(msg)

    # ---- requests --------------------------------------------------------------------
    def submit(self, request: Generate, params: dict | None = None) -> RequestHandle:
        """Queue a request (a complete Generate; its rid is stamped per attempt).
        `params` maps a field to the name the client's API gave it, for error messages
        (Responses: max_output_tokens)."""
        if self.state == BROKEN:
            raise self._unavailable()
        if self._stopping or self._draining:
            raise WorkerFailed("The server is shutting down.")
        if self._retiring:
            raise WorkerFailed(f"Model `{self.id}` is being unloaded; please retry.")
        h = self.dispatch.admit(request, params or {})
        self.last_used = self.clock()
        return h

    def adopt(self, h: RequestHandle) -> None:
        """Take over a request that another runner of this model never started (it was
        retired): it joins the queue and cancels through this runner from now on."""
        self.dispatch.adopt(h)
        self.last_used = self.clock()

    async def worker_status(self, timeout: float = 2.0) -> Status:
        return await self._query(lambda qid: StatusRequest(qid=qid), timeout)

    async def cache_command(self, op: str, name: str | None = None,
                            timeout: float = 10.0) -> CacheReply:
        """mlxctl cache: the worker's KV snapshots listed, saved, dropped or cleared (on
        its MLX thread, between two steps)."""
        return await self._query(lambda qid: CacheCommand(qid=qid, op=op, name=name), timeout)

    async def _query(self, make, timeout: float):
        """Send the message `make(qid)` and wait for the worker's answer with that qid."""
        if self.link is None or self.state not in SERVING:
            raise self._unavailable() if self.state == BROKEN else WorkerFailed(
                f"Model `{self.id}` is {self.state}.")
        return await self._queries.ask(self.link.send, make, timeout)

    def kill(self, reason: str = "killed by mlxctl kill") -> int:
        """Hard-cancel everything on the worker: what it runs ends with a retryable
        error, the process is SIGKILLed and respawned at once (not counted as a crash);
        requests not started yet (queued here, or sent ahead) wait for the new worker.
        Returns how many ended."""
        ended = self.dispatch.fail_running(
            WorkerFailed(f"The request was cancelled: the worker was {reason}."),
            started_only=True)
        if self.link is not None and self._worker_alive:
            self._verdict = Verdict(ExitCause.ADMIN, reason)
            self.link.kill()
        return ended
