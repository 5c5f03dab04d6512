"""Tokens per second over a sliding window (mlxctl status: tokens/s over the last minute).

Counts go into one-second buckets, so recording a decode step is an append or an add —
cheap enough to do for every Delta — and the window never holds more than `window_s`
buckets however fast tokens come.
"""

from __future__ import annotations

import collections


class TokenRate:
    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self._buckets: collections.deque[list] = collections.deque()  # [second, count]
        self.total = 0   # every token counted, for rates a reader takes between two looks

    def add(self, count: int, now: float) -> None:
        if count <= 0:
            return
        self.total += count
        second = int(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += count
        else:
            self._buckets.append([second, count])
            self._prune(now)

    def _prune(self, now: float) -> None:
        oldest = now - self.window_s
        while self._buckets and self._buckets[0][0] + 1 <= oldest:
            self._buckets.popleft()

    def per_second(self, now: float, since: float | None = None) -> float:
        """Tokens per second over the window, or over the time since `since` (e.g. the
        worker became ready) when that is shorter, so a fresh worker is not diluted."""
        self._prune(now)
        span = self.window_s if since is None else min(self.window_s, max(now - since, 1.0))
        return sum(c for _, c in self._buckets) / span
