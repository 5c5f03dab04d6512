"""The scheduler of an embedding or reranker worker: the one-request-at-a-time loop
(worker/loop/serial_scheduler.py) whose step is one padded batch of a request's inputs
(jobs.py). A request's result goes out whole, as one Pooled message, just before its Done.
"""

from __future__ import annotations

import logging

from protocol.messages import INTERNAL, FinishReason, Pooled, pack_floats
from worker.loop.serial_scheduler import Request, SerialScheduler

log = logging.getLogger("worker.pooling")


class PoolScheduler(SerialScheduler):
    def _step(self, req: Request) -> None:
        job = req.job
        batch = job.next_batch()
        try:
            job.store(batch, self.engine.run(*job.batch(batch)))
        except Exception:
            log.exception("rid=%s failed in a step", req.rid)
            self.current = None
            self._error(req, INTERNAL, "The model failed while computing this request.",
                        job.prompt_tokens)
            self._recover()
            return
        self.status.steps += 1
        if job.finished:
            self.current = None
            out = self.engine.finish(job)
            self.link.send(Pooled(epoch=self.epoch, rid=req.rid, rows=out.shape[0],
                                  dim=out.shape[1], data=pack_floats(out.ravel()),
                                  tokens=[len(r) for r in job.rows]))
            self._done(req, FinishReason.STOP, job.prompt_tokens)
