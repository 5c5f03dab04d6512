"""When a prefill starts: requests that arrive together are prefilled together.

The scheduler (worker/loop/scheduler.py) admits prepared requests between steps; left to
itself, a burst (8 chats sent at once) reaches the batch as the few requests prepared
first, then the rest behind their prefill: two or three prefills and merges, each a step,
where one would do, and the first ones' decode waits for each later prefill. On an H200
(2b Gemma 4, 8 short chats, issue 33) each of those steps took 120-250 ms, MLX's CUDA
backend building kernels and cuDNN graphs for every new shape, and the last of the 8 got
its first token at 0.6-0.7 s against 0.3 s for all 8 gathered.

So, while nothing in the batch decodes and it has a free slot, a prefill waits:
- for requests still being prepared that arrived less than the bound ago (their PrepDone
  is awaited, and whatever else arrives meanwhile);
- while the last two requests arrived less than QUIET apart (a burst: its clients send
  one by one, and the supervisor forwards each as it is read), QUIET after the last for
  the next;
never longer than the bound in all. The bound is GATHER, or what the last step that
began a prefill took, up to GATHER_MAX: a request that misses the prefill waits for that
step anyway, and then holds the others' decode for its own, so waiting as long as one
such step costs at most about what not waiting would (an image chat's preparation, its
image decoded and resized, took 18-36 ms on a GPU host's CPU, longer than GATHER, where
each image prefill step took 100 ms or more). A request that arrives alone is prepared
in well under a millisecond and waits for nothing; a sequence that decodes is never held
(its next token is due).
"""

from __future__ import annotations

import queue
import time

# s after a request arrives that a batch with nothing decoding waits, at least, for it to
# be prepared; 0: no gathering at all (bench.worker_timeline --gather 0).
GATHER = 0.010
# s: the most it waits for a step's sake, however long a prefill step took.
GATHER_MAX = 0.100
# s: requests of one burst arrive closer together than this.
QUIET = 0.002


class Gathering:
    """The scheduler's gathering (the module's doc). Reads the scheduler's `preparing`,
    `active`, `batch`, `link`, `stopping`, and calls its `_handle` and `_admit_waiting`."""

    _arrived = (float("-inf"), float("-inf"))  # the last two Generates' arrival (t0)
    _prefill_took = 0.0  # s: the last step that began a prefill

    def _arrival(self, t0: float) -> None:
        self._arrived = (self._arrived[1], t0)

    def _timed_step(self, step) -> None:
        """`step()`, timed when it begins a prefill (a sequence with no token yet)."""
        prefill = any(not s.completion_tokens for s in self.active.values())
        t0 = time.monotonic()
        step()
        if prefill:
            self._prefill_took = time.monotonic() - t0

    def _bound(self) -> float:
        return GATHER and max(GATHER, min(GATHER_MAX, self._prefill_took))

    def _gather(self) -> None:
        """Admit what waits, gathering first (the module's doc)."""
        until, bound = None, self._bound()
        commands = self.link.commands
        while True:
            while self.preparing and self._may_gather():
                now = time.monotonic()
                until = until or now + bound
                left = min(until, min(s.t0 for s in self.preparing.values()) + bound) - now
                if left <= 0:
                    break
                try:
                    self._handle(commands.get(timeout=left))
                except queue.Empty:
                    break
            if self.stopping:
                return
            self._admit_waiting()
            if not self._may_gather():
                return
            now = time.monotonic()
            until = until or now + bound
            if commands.empty():  # (the next of a burst)
                left = min(until, self._arrived[1] + QUIET) - now
                if not self._bursting() or left <= 0:
                    return
                try:
                    self._handle(commands.get(timeout=left))
                except queue.Empty:
                    return
            if now >= until:
                return
            while not commands.empty() and not self.stopping:  # (arrived while admitting)
                self._handle(commands.get_nowait())

    def _bursting(self) -> bool:
        """The last two requests arrived less than QUIET apart: more of a burst may come.
        (8 chats sent at once reached a tiny model's worker over 3-6 ms on a 2-core CPU:
        the first prefilled before the rest arrived, who joined three steps later.)"""
        return self._arrived[1] - self._arrived[0] < QUIET

    def _may_gather(self) -> bool:
        """Nothing decodes (a sequence with a token has its next one due), there is a
        free slot, and the worker is not stopping."""
        return (not self.stopping and len(self.active) < self.batch.max_size
                and not any(s.completion_tokens for s in self.active.values()))
