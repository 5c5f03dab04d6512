"""When a worker that ended starts again: at once, after a backoff, or never (a crash
loop), and the counts `mlxctl status` and /metrics show.

Crash restarts back off exponentially (`--restart-backoff`, doubling up to
`--restart-backoff-max`), and the backoff starts over once a worker stayed ready longer
than the crash window; more than `--crash-budget` crashes within `--crash-window` s mark
the model broken. A restart that was asked for (an admin's kill, the memory recycle) is
not a crash: it counts, but restarts at once and never breaks the model. The clock is the
runner's (injected: tests drive time)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

from supervisor.config import Config
from supervisor.workers.states import ExitCause

# Ends asked for, not crashes: restarted at once, never counted toward a crash loop.
_ASKED = (ExitCause.ADMIN, ExitCause.MEMORY)


@dataclass(frozen=True)
class Restart:
    """What comes after a worker ended: `broken` (the crash loop's reason), or a start:
    after `delay` seconds for a crash, at once for an end that was asked for."""
    crash: bool = False
    delay: float = 0.0
    broken: Optional[str] = None


class Restarts:
    def __init__(self, config: Config):
        self.config = config
        self.total = 0
        self.causes: collections.Counter = collections.Counter()  # ExitCause value -> n
        self._crashes: collections.deque[float] = collections.deque()
        self._backoff = config.restart_backoff

    def after(self, cause: ExitCause, now: float, ready_for: float, error: str) -> Restart:
        """A worker ended by `cause` at `now`, having been ready `ready_for` s (0: never);
        `error` is its last error, for a crash loop's reason."""
        self.total += 1
        self.causes[cause.value] += 1
        if cause in _ASKED:
            return Restart()
        config = self.config
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > config.crash_window:
            self._crashes.popleft()
        if len(self._crashes) > config.crash_budget:
            return Restart(crash=True, broken=f"crash loop: {len(self._crashes)} crashes within "
                                  f"{config.crash_window:g} s; last: {error}")
        if ready_for > config.crash_window:
            self._backoff = config.restart_backoff
        delay = self._backoff
        self._backoff = min(self._backoff * 2, config.restart_backoff_max)
        return Restart(crash=True, delay=delay)
