"""The scheduler of a speech worker: one request at a time (worker/loop/serial_scheduler.py),
one request being one call into the engine that reports back between its stretches of
work (a transcription's windows, a synthesis' audio chunks).

At each report the scheduler sends what was produced (Delta text, Audio samples), counts
a step (a hang is a busy worker whose steps stop), publishes the progress, and takes the
commands that came meanwhile: a new Generate goes to the preparation thread, a Cancel of
a waiting request ends it, and a Cancel of the running one (or a Shutdown) stops the
engine's call right there (`Stopped`, raised from the report) — at most one stretch late,
and the supervisor's cancel grace kills the worker if even that is too long.
"""

from __future__ import annotations

import logging

import numpy as np

from protocol.messages import INTERNAL, Audio, Delta, FinishReason, Task, Transcript
from worker.loop.serial_scheduler import Request, SerialScheduler

log = logging.getLogger("worker.speech")


class Stopped(Exception):
    """The running request was cancelled (or the worker is shutting down) mid-call."""


class SpeechScheduler(SerialScheduler):
    def _step(self, req: Request) -> None:
        try:
            if req.gen.task is Task.SPEAK:
                pieces = 0
                for samples in self.engine.run(req.job):
                    self._report(req, audio=samples)
                    pieces += bool(len(samples))  # a stream's last piece may be empty
                self.current = None
                # Usage: the text's words in, the pieces of audio out.
                self._done(req, FinishReason.STOP, req.job.prompt_tokens,
                           completion_tokens=pieces)
            else:
                out = self.engine.run(req.job, lambda texts, progress: self._report(
                    req, text="".join(texts), progress=progress))
                self.current = None
                self.link.send(Transcript(epoch=self.epoch, rid=req.rid, text=out.text,
                                          language=out.language, duration=req.job.duration,
                                          segments=out.segments, words=out.words))
                self._done(req, FinishReason.STOP, completion_tokens=out.tokens)
        except Stopped:
            return  # cancelled (its Done is sent) or shutting down (_drain ends it)
        except Exception:
            log.exception("rid=%s failed", req.rid)
            self.current = None
            self._error(req, INTERNAL, "The model failed while computing this request.")
            self._recover()
        finally:
            self.status.progress = None

    def _report(self, req: Request, *, text: str = "", audio=None,
                progress: float | None = None) -> None:
        """Between two stretches of the engine's work (see the module's docstring)."""
        if text:
            self.link.send(Delta(epoch=self.epoch, rid=req.rid, text=text))
        if audio is not None and len(audio):
            self.link.send(Audio(epoch=self.epoch, rid=req.rid,
                                 sample_rate=self.engine.sample_rate,
                                 data=np.ascontiguousarray(audio, "<f4").tobytes()))
        self.status.steps += 1
        self.status.progress = progress
        commands = self.link.commands
        while not commands.empty():
            self._handle(commands.get_nowait())
        if self.current is not req or self.stopping:
            raise Stopped()
        self._publish()
