"""What a verification step costs where it runs, so drafting stops where it does not pay.

A fixed price measured once on one machine is wrong on the next: on MLX's CPU backend a
verify pass of 1 + d positions costs about one step (the step is compute-bound and the
positions ride along), while on a GPU a small model's step is kernel launches, and
mlx-lm's plain step keeps the next one in flight (worker/loop/batch.py) where a verify
step must read its tokens before it can choose the next input (verify.py): there it
costs far more than a step. So the batch times its own steps and `StepCost` turns the
times into what a verification must earn, in accepted tokens.

How it is timed, without adding a sync: the wall clock from the end of one step to the
end of the next (the scheduler's work between steps included: a pipelined step overlaps
it, a verify step does not), for steps with no prefill chunk and the same decoding rows
as the step before, per batch size bucket (1, 2, 3-4, 5-8, ...), less the time a draft
model spent drafting in it (its passes have their own price: adaptive.py's `Pace.cost`):

- a plain step after a plain step is one sample of the plain step `T`;
- a verify step leaves nothing in flight, so the plain step after it returns at once and
  the one after that waits a whole step: the verify's cost `V` is its own period plus
  the period of the plain step right after it, less one plain step (a verify after a
  verify: its own period). Summed, these give back the run's wall time.

A verify step yields each of its n rows one token, plus what the drafting rows accepted,
for `V` where a plain step yields n tokens for `T`: it pays where the rows drafting
accept n x (V / T - 1) tokens between them (`must_earn`). Until a bucket has `ENOUGH`
samples of each, each drafting row must earn the prior (adaptive.py's MIN_GAIN); once a
bucket has timed its verify steps, it takes plain steps until T is timed too
(`wants_plain`: sequences that draft at every step would leave no plain step to time).
Medians of the last `WINDOW` samples: a step that waited on something else (a command,
the garbage collector) moves nothing.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from typing import Callable, Optional

ENOUGH = 8
WINDOW = 32
# The acceptance a draft model is priced at when it loads (`best_draft`): generous (a 4-bit
# copy of the demo model kept 78% of its drafts on an agent edit, 23-43% on prose).
ACCEPTANCE = 0.8


def best_draft(pass_cost: float, verify: float = 1.0, acceptance: float = ACCEPTANCE,
               longest: int = 8) -> tuple[int, float]:
    """(k, tokens per target step) of the draft length that pays best for a drafter whose
    pass costs `pass_cost` target steps, with a verify step of `verify` steps: drafting k
    tokens, each kept with probability `acceptance` while the ones before it were, yields
    (1 - a^(k+1)) / (1 - a) tokens (the target's own included) for k x pass_cost + verify
    steps; (0, 1.0) where no k from 1 to `longest` beats a plain step's one token."""
    best = (0, 1.0)
    for k in range(1, max(0, longest) + 1):
        tokens = sum(acceptance ** i for i in range(k + 1))
        rate = tokens / (k * pass_cost + verify)
        if rate > best[1]:
            best = (k, rate)
    return best


def bucket(rows: int) -> int:
    """The batch size bucket of `rows` decoding rows: the power of two at or above it."""
    return 1 << max(0, rows - 1).bit_length()


class StepCost:
    def __init__(self, prior: float, clock: Callable[[], float] = time.perf_counter):
        self.prior = prior
        self._clock = clock
        self.plain: dict[int, deque] = {}
        self.verify: dict[int, deque] = {}
        self._then: Optional[float] = None   # when the last step ended
        self._last: Optional[tuple] = None   # (rows, verified) of the last clean step
        self._pending: Optional[float] = None  # the period of a verify step
        self._extra: dict[int, float] = {}   # bucket -> V / T - 1, once measured
        self._drafted = 0.0                  # seconds of draft passes in this step
        self._added: dict[int, int] = {}     # bucket -> samples added

    @contextlib.contextmanager
    def drafting(self):
        """A draft model's passes: not the verify step's cost (adaptive.py's `Pace`
        prices them by the draft's own measured cost)."""
        t = self._clock()
        try:
            yield
        finally:
            self._drafted += self._clock() - t

    def stepped(self, rows: int, verified: Optional[bool]) -> None:
        """A step ended: `rows` sequences decoded in it, by a verify step (True), a plain
        pipelined one (False), or neither cleanly (None: a prefill chunk in it, a verify
        that fell back to a plain step): no sample, and the next step's period starts
        here."""
        now = self._clock()
        period = None if self._then is None else now - self._then - self._drafted
        self._then, self._drafted = now, 0.0
        last, self._last = self._last, (rows, verified) if verified is not None and rows \
            else None
        pending, self._pending = self._pending, None
        if period is None or self._last is None or last is None or last[0] != rows:
            return
        if pending is not None:  # (the step after a verify: the verify's cost is known)
            self._add(self.verify, rows, (pending, None if verified else period))
        if verified:
            self._pending = period
        elif not last[1]:
            self._add(self.plain, rows, period)

    def wants_plain(self, rows: int) -> bool:
        """Whether this batch size needs plain steps timed now: its verify steps were
        timed but too few plain steps to price them against (a sequence drafting at every
        step, or every other, leaves none), so the batch takes plain steps until it has
        `ENOUGH` (once per batch size, for the batch's life)."""
        b = bucket(rows)
        return len(self.verify.get(b, ())) >= ENOUGH and len(self.plain.get(b, ())) < ENOUGH

    def measured(self, rows: int) -> Optional[float]:
        """V / T - 1 at this batch size: what one verification costs over a plain step,
        in plain steps (None: not yet timed)."""
        return self._extra.get(bucket(rows))

    def extra(self, rows: int) -> float:
        """`measured`, else the prior."""
        extra = self.measured(rows)
        return self.prior if extra is None else extra

    def must_earn(self, rows: int, drafting: int) -> float:
        """Accepted tokens each of `drafting` rows must bring a verify step of `rows` rows
        for it to pay (the prior, per row, until measured)."""
        extra = self.measured(rows)
        return self.prior if extra is None else extra * rows / max(1, drafting)

    def _add(self, samples: dict, rows: int, sample) -> None:
        b = bucket(rows)
        samples.setdefault(b, deque(maxlen=WINDOW)).append(sample)
        self._added[b] = added = self._added.get(b, 0) + 1
        if b in self._extra and added % ENOUGH:
            return  # (the medians again every ENOUGH samples: a step's time stays ~1 us)
        plain, verify = self.plain.get(b, ()), self.verify.get(b, ())
        if len(plain) >= ENOUGH and len(verify) >= ENOUGH:
            t = statistics.median(plain)
            if t > 0:
                cost = statistics.median(own + (after - t if after is not None else 0.0)
                                         for own, after in verify)
                self._extra[b] = max(0.0, cost / t - 1)
