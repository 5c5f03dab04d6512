"""Faults on purpose, for the fault tests only (tests/faults/).

`MLXD_TEST_FAULTS="crash_after_tokens=3"` makes the worker process exit (code 1, no
goodbye) as soon as any sequence has produced that many tokens: a crash in the middle of
a generation, at a moment a test can choose, in a real worker driven by a real
supervisor. `hang_on_group_lost=1` makes a worker group's leader, once a step failed for a
lost rank, run the lost group's collectives on until one never returns (the ring backend's
collectives whose peer died: worker/group/leader.py), as when more of a step's collectives
were queued behind the one that failed: its main thread blocked in MLX's C++. Unset (always, outside those tests), nothing here runs: the scheduler holds
None. A worker started with it logs so at once, so a fault can never pass unnoticed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping

ENV = "MLXD_TEST_FAULTS"
log = logging.getLogger("worker.faults")
MAX_COLLECTIVES = 10  # hang_on_group_lost gives up (the step's failure goes on) after these


@dataclass(frozen=True)
class Faults:
    crash_after_tokens: int | None = None
    hang_on_group_lost: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Faults | None":
        spec = environ.get(ENV, "").strip()
        if not spec:
            return None
        values = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key.strip() not in cls.__dataclass_fields__:
                raise ValueError(f"{ENV}: unknown fault {key.strip()!r}")
            values[key.strip()] = int(value)
        faults = cls(**values)
        log.warning("TEST FAULTS ENABLED (%s=%s): this worker will fail on purpose", ENV, spec)
        return faults

    def after_token(self, produced: int) -> None:
        """Called by the scheduler each time a sequence produced a token."""
        if self.crash_after_tokens is not None and produced >= self.crash_after_tokens:
            log.critical("test fault: exiting after %d tokens", produced)
            logging.shutdown()
            os._exit(1)

    def group_lost(self) -> None:
        """Called by a group's leader whose step failed because a rank is gone. Armed, it
        does not return: the ring backend fails a lost peer's pending transfers once and
        stops that socket's thread, so a later collective waits forever (the third at
        most: one per socket to fail, one to find both threads gone)."""
        if not self.hang_on_group_lost:
            return
        import mlx.core as mx

        log.critical("test fault: the leader runs the lost group's collectives on")
        for _ in range(MAX_COLLECTIVES):
            try:
                mx.eval(mx.distributed.all_sum(mx.ones((64,))))
            except RuntimeError:
                continue
        log.critical("test fault: no collective of the lost group blocked")
