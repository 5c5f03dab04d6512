"""The scheduler: the loop on the one thread that owns MLX.

Each turn: take new commands (without blocking while there is work; blocking briefly when
idle) → apply cancels → advance each active sequence by ONE prefill chunk or ONE decode
step → queue that step's events for the sender thread (steps faster than the stream
interval share one Delta). So a Cancel or a new request is
seen between any two steps, however long the generation.

A new Generate goes to the preparation thread first (worker/loop/preparer.py: tokenizing and
grammar compiling, which can take seconds, never hold this thread); its outcome comes
back on the command queue, and a prepared request waits for a slot.

Guarantees the supervisor relies on:
- every Generate gets exactly one terminal Done, also when it only waited, was being
  prepared, was cancelled, failed, or the worker shut down (a worker that gives up, see
  WorkerBroken below, leaves what it never started to the supervisor's re-queue);
- Cancel is idempotent: an unknown or finished rid is ignored;
- a failure inside one request (not of the worker) ends that request with Error + Done
  ("error") and the worker keeps serving: after an unexpected failure inside a step the
  engine drops what the step left in MLX's state and proves a step still runs
  (`engine.recover`). If it cannot, `run` raises WorkerBroken: the process exits and the
  supervisor starts a fresh one (re-queueing what never started) rather than this one
  answering every later request with an error.

Sequences live in `preparing` (handed to the preparation thread), `waiting` (prepared,
FIFO) and `active` (in the batch: worker/loop/batch.py). Prepared requests join the batch in
arrival order while it has a free slot and KV room (the first that does not fit waits,
and so do those behind it: no starvation of large requests). Each turn advances every
active sequence by one batched step. A step that fails cannot be pinned on one sequence:
those that already streamed end with an error, the others run again one at a time until
their first token (so the one that fails again is the culprit), and the engine proves a
step still runs before anything else does (`_batch_failed`). While nothing decodes, a
prefill waits briefly for requests that arrived with it (worker/loop/gathering.py), so a
burst is prefilled together.
"""

from __future__ import annotations

import itertools
import logging
import queue
import struct
import time
from collections import deque

import mlx.core as mx

from protocol.messages import (
    INTERNAL, INVALID_REQUEST, CacheCommand, Cancel, Delta, Done, Error, FinishReason, Generate,
    Shutdown, Started, StatusRequest,
)
from protocol.settings import BY_NAME
from worker.kvcache import admin as cache_admin
from worker.loop import echo
from worker.loop.batch import Batch
from worker.loop.gathering import Gathering
from worker.errors import RequestError, WorkerBroken
from worker.loop.preparer import PrepDone, Preparer, prepare
from worker.loop.sequence import Held, Sequence
from worker.text.tokens import Answered

log = logging.getLogger("worker.loop.scheduler")

_IDLE_WAIT = 0.1         # s; idle get() timeout, so memory figures stay fresh
_MEMORY_EVERY = 0.1      # s; how often the MLX thread refreshes the memory figures
PREPARERS = 2  # preparation threads (worker/loop/preparer.py says why two)
_pack1 = struct.Struct("<I").pack  # == protocol.pack_ids([tok]) for one id, cheaper
CANCELLED = FinishReason.CANCELLED


def return_buffers() -> None:
    """MLX's buffer cache back to the system. (mlx-lm also clears it after each prefill
    chunk; this is the scheduler's own, between requests.)"""
    mx.clear_cache()


class Scheduler(Gathering):
    def __init__(self, engine, link, status, batch: Batch, *, log_prompts: bool = False,
                 stream_interval: float = 0.0,
                 buffer_cache_idle: float = BY_NAME["buffer_cache_idle"].default,
                 faults=None):
        self.engine = engine
        self.batch = batch
        batch.hold_stores()  # (`_step` settles once the step's events are out)
        # Steps that come faster than this share one Delta: at ~1 ms a token, a message
        # per token wakes the sender thread, the supervisor and the client once a token,
        # and those wake-ups preempt MLX's compute threads. Slower steps (any real model
        # on Apple Silicon) still go out one by one, at once.
        self.stream_interval = stream_interval
        # Seconds idle before MLX's buffer cache goes back to the system
        # (protocol/settings.py `buffer_cache_idle` says why not at once).
        self.buffer_cache_idle = buffer_cache_idle
        self.link = link
        self.status = status
        self.epoch = status.epoch
        self.log_prompts = log_prompts
        self.faults = faults  # worker/faults.py: tests only, else None
        self.active: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.preparing: dict[str, Sequence] = {}
        self.preparer = Preparer(self._prepare, link.commands, threads=PREPARERS)
        self.stopping = False
        self._next_memory = 0.0
        self._clear_at: float | None = None   # when the buffer cache goes back, if idle

    # ---- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Serve until Shutdown (or SIGTERM, which arrives as a Shutdown command).
        Raises WorkerBroken when a failed request left MLX unable to run a step."""
        self.preparer.start()
        try:
            self._serve()
        finally:
            self.preparer.stop()

    def _serve(self) -> None:
        self._publish(memory=True)
        commands = self.link.commands
        while not self.stopping:
            busy = bool(self.active or self.waiting)
            if not busy:
                try:
                    self._handle(commands.get(timeout=_IDLE_WAIT))
                except queue.Empty:
                    self._release_when_idle()
                    self.batch.idle()
                    self._publish(memory=True)
                    continue
            while not commands.empty():
                self._handle(commands.get_nowait())
            self._gather()
            if self.stopping:
                break
            if self.active:
                self._timed_step(self._step)
            if time.monotonic() >= self._next_memory:
                self._publish(memory=True)
        self.drain()

    def drain(self) -> None:
        """Shutdown: end every request (Done cancelled), including those still queued or
        being prepared (their preparation's outcome is ignored when it comes)."""
        self.status.publish("draining", self.active, self._queued())
        for seq in list(self.active.values()):
            self._finish(seq, CANCELLED)
        while self.waiting:
            self._finish(self.waiting.popleft(), CANCELLED)
        for seq in list(self.preparing.values()):
            self._drop_preparing(seq)
        # Commands that arrived after the Shutdown may hold Generates: answer them too.
        while not self.link.commands.empty():
            cmd = self.link.commands.get_nowait()
            if isinstance(cmd, Generate):
                self.link.send(Done(epoch=self.epoch, rid=cmd.rid, finish_reason=CANCELLED))

    # ---- commands ---------------------------------------------------------------------

    def _handle(self, cmd) -> None:
        if isinstance(cmd, PrepDone):
            self._prepared(cmd.seq, cmd.result)
        elif isinstance(cmd, Generate):
            if (cmd.rid in self.active or cmd.rid in self.preparing
                    or any(s.rid == cmd.rid for s in self.waiting)):
                # Request ids are unique per attempt; a repeat is a supervisor bug, and a
                # second Done for the same rid would end the first request.
                log.warning("ignored a duplicate Generate for rid=%s", cmd.rid)
                return
            seq = Sequence(cmd)
            self._arrival(seq.t0)
            self.preparing[seq.rid] = seq
            self.preparer.submit(seq)
            self._publish()
        elif isinstance(cmd, Cancel):
            self._cancel(cmd.rid)
        elif isinstance(cmd, Shutdown):
            self.stopping = True
        elif isinstance(cmd, StatusRequest):  # normally answered by the I/O thread
            self.link.send(self.status.status(cmd.qid))
        elif isinstance(cmd, CacheCommand):
            self.link.send(cache_admin.answer(self.batch.kvcache, cmd, self.epoch))

    def _prepare(self, gen: Generate):
        """The preparation thread's work (worker/loop/preparer.py)."""
        return prepare(self.engine, self.batch.kvcache, gen)

    def _cancel(self, rid: str) -> None:
        seq = self.active.get(rid)
        if seq is None:
            seq = self.preparing.get(rid)
            if seq is not None:  # answered now; its preparation's outcome is dropped
                self._drop_preparing(seq)
                return
            for s in self.waiting:
                if s.rid == rid:
                    seq = s
                    break
            else:
                return  # unknown or already finished: idempotent, no second Done
            self.waiting.remove(seq)
        self._finish(seq, CANCELLED)

    # ---- sequences --------------------------------------------------------------------

    def _drop_preparing(self, seq: Sequence) -> None:
        """End a request still on the preparation thread: its Done goes out now; the
        thread skips it if it has not begun, and its outcome is ignored."""
        del self.preparing[seq.rid]
        seq.dropped = True
        self._finish(seq, CANCELLED)

    def _prepared(self, seq: Sequence, result) -> None:
        """A preparation's outcome: queue the request, or end it with its error."""
        if seq.dropped:
            return  # cancelled (or drained) while it was prepared: already answered
        del self.preparing[seq.rid]
        if isinstance(result, RequestError):
            self._refuse(seq, result)
        elif isinstance(result, Exception):
            log.error("rid=%s failed in preparation", seq.rid,
                      exc_info=(type(result), result, result.__traceback__))
            self._fail(seq)
        elif isinstance(result, Answered):
            self._answer(seq, result)
        else:
            seq.prep = result
            self._queue(seq)
            self._publish()

    def _queue(self, seq: Sequence) -> None:
        """`seq` into `waiting` by arrival, behind the suspects re-queued at its front:
        the preparation threads may finish a later request first (worker/loop/preparer.py),
        and of the prepared ones the earliest is admitted first."""
        i = len(self.waiting)
        while i and not self.waiting[i - 1].suspect and self.waiting[i - 1].t0 > seq.t0:
            i -= 1
        self.waiting.insert(i, seq)

    def _answer(self, seq: Sequence, answered: Answered) -> None:
        """Tokenize or detokenize, answered whole in preparation: its result and its
        Done, without joining the batch."""
        seq.prompt_tokens = answered.prompt_tokens
        for msg in answered.messages(self.epoch, seq.rid):
            self.link.send(msg)
        self._finish(seq, FinishReason.STOP)

    def _refuse(self, seq: Sequence, e: RequestError) -> None:
        """A request error (a 400-class one, safe to show): Error + Done("error")."""
        seq.prompt_tokens = seq.prompt_tokens or e.prompt_tokens
        self._flush(seq)
        self.link.send(Error(epoch=self.epoch, code=e.code, message=e.message, rid=seq.rid,
                             param=e.param))
        self._finish(seq, FinishReason.ERROR, log_it=False)
        log.info("rid=%s refused: %s", seq.rid, e.code)

    def _admit_waiting(self) -> None:
        """Prepared requests join the batch in order while they fit. A suspect (see
        `_batch_failed`) joins only an empty batch, and nothing joins it until it has
        produced a token: a failure then has one cause. A repeat of a prompt a sequence
        is prefilling (a request's `n` choices) keeps its place until that prompt's state
        is kept, and the requests after it go ahead (worker/loop/batch.py `same`)."""
        later = []  # repeats of a prompt being prefilled: they start from it once kept
        try:
            while self.waiting and self.batch.fits(self.waiting[0].prep):
                if any(s.suspect for s in self.active.values()):
                    return
                head = self.waiting[0]
                if head.suspect and self.active:
                    return
                if self.batch.shares_prompts:  # (worker/loop/batch.py `same`: n choices)
                    if self.batch.waits(head.prep):
                        # Started now: its prompt is being prefilled, and a long prefill
                        # must not run the supervisor's queue timeout out on it.
                        head.prompt_tokens = len(head.prep.ids)
                        self._started(head)
                        later.append(self.waiting.popleft())
                        continue
                    head.prep.shared = head.gen.cache.repeats > 0 or any(
                        self.batch.same(head.prep, s.prep)
                        for s in itertools.islice(self.waiting, 1, None))
                self._admit(self.waiting.popleft())
        finally:
            self.waiting.extendleft(reversed(later))

    def _admit(self, seq: Sequence) -> None:
        gen, prep = seq.gen, seq.prep  # (kept until its first token: it may start again)
        seq.prompt_tokens = len(prep.ids)
        # Prompt text in logs needs both the operator's --log-prompts and the request's
        # own permission; by default logs carry ids and counts only.
        if self.log_prompts and gen.log_prompt:
            log.info("rid=%s prompt=%r", seq.rid, gen.messages if gen.messages is not None
                     else gen.prompt)
        if gen.output.echo and gen.output.logprobs and not self.batch.scores_prompts:
            self._refuse(seq, RequestError(INVALID_REQUEST, echo.REFUSED, "echo"))
            return
        alone = gen.output.echo and gen.sampling.max_tokens == 0  # the prompt alone
        if not alone:
            seq.cached_tokens = self.batch.add(seq, prep)
            self.active[seq.rid] = seq
        elif gen.output.logprobs:
            self.batch.scored(prep)  # (its rows on `prep`; the state is not kept)
        self._started(seq)
        if alone:
            self._finish(seq, FinishReason.LENGTH)
            return
        self._publish()

    def _started(self, seq: Sequence) -> None:
        """The request's Started, once (and an echo's prompt: worker/loop/echo.py)."""
        if not seq.started:
            seq.started = True
            self.link.send(Started(epoch=self.epoch, rid=seq.rid,
                                   prompt_tokens=seq.prompt_tokens,
                                   cached_tokens=seq.cached_tokens))
            if seq.gen.output.echo:  # (the prompt, before any output)
                self.link.send(echo.delta(self.engine, seq.prep, self.epoch, seq.rid))

    def _step(self) -> None:
        """One batched step: a decode step for every generating sequence, one prefill
        chunk for those being prefilled."""
        try:
            results = self.batch.step()
        except WorkerBroken:
            raise  # the batch says no step can run here (a worker group lost a rank)
        except Exception:
            self._batch_failed()
            return
        self.status.steps += 1
        for seq, out in results:
            if isinstance(out, RequestError):  # the request's own fault (a grammar it
                self._refuse(seq, out)         # cannot follow)
            elif isinstance(out, Exception):
                log.error("rid=%s failed", seq.rid, exc_info=(type(out), out, out.__traceback__))
                self._fail(seq)
            else:
                self._emit(seq, out)
        try:  # ended sequences' states into the KV cache, once their Done is out
            self.batch.settle()
        except Exception:
            self._batch_failed()

    def _batch_failed(self) -> None:
        """A batched step raised, and a step has many sequences: which one caused it?
        A sequence alone in the batch, or one that already streamed tokens (it cannot
        start over unseen), ends with an error. The others have sent nothing yet: they
        go back to the front of the queue as suspects, each to run alone until its
        first token, so the one that fails again is the one that fails. A step must be
        proven to run (`engine.recover`) before anything runs again."""
        seqs = self.batch.reset()
        log.exception("a batched step failed (%d requests in it)", len(seqs))
        retry = []
        for seq in seqs:
            if len(seqs) > 1 and seq.completion_tokens == 0 and not seq.held_text:
                retry.append(seq)
            else:
                self._fail(seq)
        try:
            self._recover(", ".join(s.rid for s in seqs))
        except WorkerBroken:
            for seq in retry:  # started: end them here rather than leave them to a death
                self._fail(seq)
            raise
        for seq in reversed(retry):
            del self.active[seq.rid]
            seq.suspect = True
            seq.prep = self.engine.restart(seq.prep)
            self.waiting.appendleft(seq)

    def _emit(self, seq: Sequence, out) -> None:
        """A sequence's step outcome: held for its next Delta, or its end."""
        tok, text, finish, extra = out
        seq.suspect = False  # it ran a step: cleared, its prompt is no longer needed
        seq.prep = None
        if tok >= 0:  # (EOS comes as -1: no token to report, only text held back)
            seq.completion_tokens += 1
            seq.held_ids += _pack1(tok)
            if self.faults is not None:
                self.faults.after_token(seq.completion_tokens)
        seq.held_text += text
        if extra is not None:
            if seq.held is None:
                seq.held = Held()
            seq.held.add(extra)
            if extra.in_reasoning and tok >= 0:
                seq.reasoning_tokens += 1
        if finish is not None:
            self._finish(seq, finish)
        elif seq.held_ids and time.monotonic() - seq.sent_at >= self.stream_interval:
            self._flush(seq)

    def _flush(self, seq: Sequence) -> None:
        held = seq.held
        if held is not None:
            if seq.held_ids or seq.held_text or held.reasoning or held.tool_calls \
                    or held.cut_call or held.logprobs:  # (the last: an EOS's row alone)
                self.link.send(Delta(epoch=self.epoch, rid=seq.rid, text=seq.held_text,
                                     token_ids=seq.held_ids, **held.fields()))
                seq.held = None
                seq.held_text, seq.held_ids = "", b""
                seq.sent_at = time.monotonic()
        elif seq.held_ids or seq.held_text:
            self.link.send(Delta(epoch=self.epoch, rid=seq.rid, text=seq.held_text,
                                 token_ids=seq.held_ids))
            seq.held_text, seq.held_ids = "", b""
            seq.sent_at = time.monotonic()

    def _fail(self, seq: Sequence) -> None:
        """An unexpected error in one request (logged by the caller): report it safely."""
        self._flush(seq)
        self.link.send(Error(epoch=self.epoch, code=INTERNAL, rid=seq.rid,
                             message="internal error while generating; see the server log"))
        self._finish(seq, FinishReason.ERROR, log_it=False)

    def _recover(self, rids: str) -> None:
        """After a failed step: prove that a step still runs, or give up the process."""
        try:
            self.engine.recover()
        except Exception as e:
            log.critical("rid=%s left MLX unable to run a step (%s: %s); this worker must "
                         "be replaced", rids, type(e).__name__, str(e)[:200])
            raise WorkerBroken(str(e)[:200]) from e
        log.info("rid=%s failed; the worker recovered and keeps serving", rids)

    def _finish(self, seq: Sequence, reason: FinishReason, *, log_it: bool = True) -> None:
        """Send the one Done of a request and forget it."""
        if self.active.pop(seq.rid, None) is not None:
            self.batch.remove(seq)  # (a no-op if the batch already let it go)
        self._flush(seq)
        self.link.send(Done(epoch=self.epoch, rid=seq.rid, finish_reason=reason,
                            prompt_tokens=seq.prompt_tokens,
                            completion_tokens=seq.completion_tokens,
                            cached_tokens=seq.cached_tokens,
                            reasoning_tokens=seq.reasoning_tokens,
                            stop_sequence=seq.stop_sequence,
                            accepted_prediction_tokens=seq.draft_accepted,
                            rejected_prediction_tokens=seq.draft_rejected))
        if log_it:
            dt = time.monotonic() - seq.t0
            log.info("rid=%s done: %s, %d prompt + %d completion tokens in %.2fs", seq.rid,
                     reason, seq.prompt_tokens, seq.completion_tokens, dt)
        if not self.active:
            # The buffer cache goes back to the system once the worker has been idle a
            # while (`buffer_cache_idle`), not at once: the next request (a client's next
            # call, an agent's next turn) would allocate every buffer anew.
            self._clear_at = time.monotonic() + self.buffer_cache_idle
        self._publish(memory=True)

    def _release_when_idle(self) -> None:
        if self._clear_at is not None and not self.active \
                and time.monotonic() >= self._clear_at:
            return_buffers()
            self._clear_at = None

    # ---- status -----------------------------------------------------------------------

    def _publish(self, memory: bool = False) -> None:
        state = "draining" if self.stopping else (
            "busy" if self.active or self.waiting or self.preparing else "ready")
        # None: keep the last published figures
        active_bytes = peak_bytes = buffers = cache = kv = spec = None
        if memory:
            # Only this thread may call MLX; the I/O threads read the published figures.
            self._next_memory = time.monotonic() + _MEMORY_EVERY
            active_bytes, peak_bytes = mx.get_active_memory(), mx.get_peak_memory()
            buffers = mx.get_cache_memory()
            cache = self.batch.cache_stats()
            kv = getattr(self.batch, "kv_stats", lambda: None)()
            spec = getattr(self.batch, "speculation_stats", lambda: None)()
        self.status.publish(state, self.active, self._queued(), active_bytes, peak_bytes,
                            cache, buffers, kv, spec)

    def _queued(self) -> list:
        """Rids accepted and not started: prepared ones first, then those in preparation."""
        return [s.rid for s in self.waiting] + list(self.preparing)
