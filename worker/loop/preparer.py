"""The preparation thread: requests are tokenized and their grammars compiled here, off
the MLX thread.

`TextEngine.prepare` (chat template, tokenization, grammar compilation) calls no MLX,
but can take long: a big prompt's tokenization, a big schema's compilation. Done on the
MLX thread it would stall every running sequence and every Cancel for that long. So the
scheduler hands each Generate to these threads, which take them in arrival order, and
each puts its outcome on the scheduler's own command queue as a `PrepDone`, where it
wakes the scheduler like any command; the scheduler admits prepared requests between
steps. The batched scheduler runs two (`threads`): one request's long preparation (a
grammar's compile may take its whole 10 s budget, a 100K-token prompt's tokenizing a
tenth of a second) does not hold up the requests behind it, and a burst of image
requests (each an image decode and the processor's resize, 18-36 ms on a GPU host's
CPU: a burst of 8 reached its batch in three groups, session 14) is prepared two at a
time, the image libraries releasing the GIL for much of it. So outcomes may come in
another order than the requests; the scheduler queues them by arrival.

Every `submit` yields exactly one PrepDone (with None as its result when the request was
dropped, `seq.dropped`, before its preparation began), so the scheduler knows when a
request has left these threads. They never call MLX (MLX state is per thread, and Metal
work from a second thread crashes), and what they call is safe to run twice at once
(the engine's tokenizer, template, grammar cache, image processor: worker/vision/
processed.py keeps each call's state per thread).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, NamedTuple

from worker.text.engine import Prepared

_STOP = object()


def prepare(engine, kvcache, gen):
    """A request's preparation: the engine's, then the snapshot to resume from when only
    the disk has it (a file read must not stall the MLX thread). `kvcache`: the batch's
    KV cache manager (worker/kvcache/manager.py), or None."""
    prep = engine.prepare(gen)
    if isinstance(prep, Prepared) and kvcache is not None:
        prep.snapshot = kvcache.preload(gen.cache)
    return prep


class PrepDone(NamedTuple):
    """The outcome of one preparation: a Prepared, the exception prepare raised, or None
    (skipped: cancelled before it began)."""
    seq: object
    result: object


class Preparer:
    def __init__(self, prepare: Callable, results: queue.SimpleQueue, threads: int = 1):
        self._prepare = prepare
        self._results = results        # the scheduler's command queue
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, daemon=True,
                                          name="prepare" if not i else f"prepare-{i + 1}")
                         for i in range(max(1, threads))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, seq) -> None:
        self._todo.put(seq)

    def stop(self) -> None:
        """Prepare nothing more. Does not wait: a preparation under way ends on its own
        (a grammar compile within its budget) and its outcome is ignored."""
        for _ in self._threads:
            self._todo.put(_STOP)

    def _loop(self) -> None:
        while (seq := self._todo.get()) is not _STOP:
            if seq.dropped:  # set by the scheduler's thread; a plain attribute read
                result = None
            else:
                try:
                    result = self._prepare(seq.gen)
                except Exception as e:  # the scheduler reports it; this thread goes on
                    result = e
            self._results.put(PrepDone(seq, result))
