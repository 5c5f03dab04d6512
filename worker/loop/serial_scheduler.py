"""The scheduler of a worker that runs one request at a time: the loop on the thread that
owns MLX, for embedding and reranker models (worker/pooling/) and speech models
(worker/speech/).

Like the generation scheduler (worker/loop/scheduler.py), and with the same guarantees: every
Generate gets exactly one Done (also when it waited, was being prepared, was cancelled,
failed, or the worker shut down); Cancel is idempotent; preparing a request (tokenizing,
decoding an audio file) runs on the preparation thread, never here. It is simpler because
a request's inputs are known at once: requests run one after another, in arrival order,
and commands are taken between steps, so a Cancel stops a long request within a step.
What a step is belongs to the subclass (`_step`): a padded batch of inputs for pooling,
a stretch of audio for speech.

A failure inside a step fails that request alone (Error + Done "error"); the engine then
proves a step still runs (`_recover`), and if it cannot, `run` raises WorkerBroken: the
supervisor starts a fresh worker.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque

import mlx.core as mx

from protocol.messages import (INTERNAL, Cancel, Done, Error, FinishReason, Generate,
                               Shutdown, Started, StatusRequest)
from worker.loop.preparer import PrepDone, Preparer
from worker.errors import RequestError
from worker.errors import WorkerBroken
from worker.text.tokens import Answered

log = logging.getLogger("worker.serial")

_IDLE_WAIT = 0.1  # s: idle get() timeout, so memory figures stay fresh


class Request:
    __slots__ = ("gen", "rid", "job", "dropped", "t0")

    def __init__(self, gen: Generate):
        self.gen, self.rid = gen, gen.rid
        self.job = None         # what the engine prepared (it has `prompt_tokens`)
        self.dropped = False    # answered while being prepared: its outcome is ignored
        self.t0 = time.monotonic()


class SerialScheduler:
    """The loop; a subclass says what one step of the current request is (`_step`) and
    how the engine proves it still works after a failed one (`_recover`)."""

    def __init__(self, engine, link, status):
        self.engine = engine
        self.link = link
        self.status = status
        self.epoch = status.epoch
        self.preparing: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.current: Request | None = None
        self.preparer = Preparer(engine.prepare, link.commands)
        self.stopping = False

    def run(self) -> None:
        self.preparer.start()
        try:
            self._serve()
        finally:
            self.preparer.stop()

    def _serve(self) -> None:
        commands = self.link.commands
        self._publish()
        while not self.stopping:
            if self.current is None and not self.waiting:
                try:
                    self._handle(commands.get(timeout=_IDLE_WAIT))
                except queue.Empty:
                    self._publish()
                    continue
            while not commands.empty():
                self._handle(commands.get_nowait())
            if self.stopping:
                break
            if self.current is None and self.waiting:
                self._start(self.waiting.popleft())
            if self.current is not None:
                self._step(self.current)
        self._drain()

    # ---- commands -------------------------------------------------------------------
    def _handle(self, cmd) -> None:
        if isinstance(cmd, PrepDone):
            self._prepared(cmd.seq, cmd.result)
        elif isinstance(cmd, Generate):
            if cmd.rid in self.preparing or self._find(cmd.rid) is not None:
                log.warning("ignored a duplicate Generate for rid=%s", cmd.rid)
                return
            req = Request(cmd)
            self.preparing[req.rid] = req
            self.preparer.submit(req)
            self._publish()
        elif isinstance(cmd, Cancel):
            self._cancel(cmd.rid)
        elif isinstance(cmd, Shutdown):
            self.stopping = True
        elif isinstance(cmd, StatusRequest):
            self.link.send(self.status.status(cmd.qid))

    def _find(self, rid: str) -> Request | None:
        if self.current is not None and self.current.rid == rid:
            return self.current
        return next((r for r in self.waiting if r.rid == rid), None)

    def _cancel(self, rid: str) -> None:
        req = self.preparing.pop(rid, None)
        if req is not None:
            req.dropped = True
        else:
            req = self._find(rid)
            if req is None:
                return  # unknown or finished: idempotent
            if req is self.current:
                self.current = None
            else:
                self.waiting.remove(req)
        self._done(req, FinishReason.CANCELLED)

    def _prepared(self, req: Request, result) -> None:
        if req.dropped:
            return
        del self.preparing[req.rid]
        if isinstance(result, RequestError):
            self._refuse(req, result)
        elif isinstance(result, Exception):
            log.error("rid=%s failed in preparation", req.rid,
                      exc_info=(type(result), result, result.__traceback__))
            self._error(req, INTERNAL, "The worker failed to prepare this request.")
        elif isinstance(result, Answered):
            for msg in result.messages(self.epoch, req.rid):
                self.link.send(msg)
            self._done(req, FinishReason.STOP, result.prompt_tokens)
        else:
            req.job = result
            self.waiting.append(req)
            self._publish()

    # ---- running ----------------------------------------------------------------------
    def _start(self, req: Request) -> None:
        self.current = req
        self._send_started(req, req.job.prompt_tokens)
        self._publish()

    def _step(self, req: Request) -> None:
        """Advance the current request by one step; when it ends, send its result and
        its Done and clear `current`."""
        raise NotImplementedError

    def _recover(self) -> None:
        """After a failed step: prove a step still runs, else raise WorkerBroken."""
        mx.clear_cache()
        try:
            self.engine.probe()
        except Exception as e:
            raise WorkerBroken() from e

    # ---- endings ----------------------------------------------------------------------
    def _send_started(self, req: Request, prompt_tokens: int) -> None:
        self.link.send(Started(epoch=self.epoch, rid=req.rid, prompt_tokens=prompt_tokens))

    def _refuse(self, req: Request, e: RequestError) -> None:
        self.link.send(Error(epoch=self.epoch, code=e.code, message=e.message, rid=req.rid,
                             param=e.param))
        self._done(req, FinishReason.ERROR, e.prompt_tokens, log_it=False)
        log.info("rid=%s refused: %s", req.rid, e.code)

    def _error(self, req: Request, code, message: str, prompt_tokens: int = 0) -> None:
        self.link.send(Error(epoch=self.epoch, code=code, message=message, rid=req.rid))
        self._done(req, FinishReason.ERROR, prompt_tokens)

    def _done(self, req: Request, reason: FinishReason, prompt_tokens: int = 0, *,
              log_it: bool = True, completion_tokens: int = 0) -> None:
        self.link.send(Done(epoch=self.epoch, rid=req.rid, finish_reason=reason,
                            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))
        if log_it:
            log.info("rid=%s done: %s, %d tokens in %.2fs", req.rid, reason, prompt_tokens,
                     time.monotonic() - req.t0)
        self._publish()

    def _drain(self) -> None:
        """Shutdown: every request still here ends with Done "cancelled"."""
        self.status.publish("draining", self._active(), self._queued())
        if self.current is not None:
            req, self.current = self.current, None
            self._done(req, FinishReason.CANCELLED)
        while self.waiting:
            self._done(self.waiting.popleft(), FinishReason.CANCELLED)
        for req in list(self.preparing.values()):
            req.dropped = True
            self._done(req, FinishReason.CANCELLED)
        self.preparing.clear()
        while not self.link.commands.empty():
            cmd = self.link.commands.get_nowait()
            if isinstance(cmd, Generate):
                self.link.send(Done(epoch=self.epoch, rid=cmd.rid,
                                    finish_reason=FinishReason.CANCELLED))

    # ---- status -----------------------------------------------------------------------
    def _active(self) -> list[str]:
        return [self.current.rid] if self.current is not None else []

    def _queued(self) -> list[str]:
        return [r.rid for r in self.waiting] + list(self.preparing)

    def _publish(self) -> None:
        state = "draining" if self.stopping else (
            "busy" if self.current or self.waiting or self.preparing else "ready")
        self.status.publish(state, self._active(), self._queued(), mx.get_active_memory(),
                            mx.get_peak_memory())
