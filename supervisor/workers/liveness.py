"""Is a worker alive? What its heartbeats said, and the verdict that kills it.

Three signals (DESIGN.md): process exit (the runner sees it through `link.wait()`),
heartbeats (sent by the worker's I/O thread, so they flow even inside a long step), and
step progress while busy. A cancel left unanswered past the grace period also condemns
the worker: only a kill makes the cancel real then. And a worker whose MLX memory, idle,
is over its limit is recycled: between requests nothing is lost, and a fresh process
gives back whatever grew (a leak, fragmentation) that no request will.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from protocol import Heartbeat
from protocol.messages import CacheStats, KVStats, SpeculationStats
from supervisor.config import Config
from supervisor.workers.states import ExitCause, Verdict


# Steps the worker must have taken since a cancel was sent before an unanswered cancel
# condemns it: the count is the last heartbeat's, so the step that was running when the
# cancel arrived may show up after it; the third is certainly one that began after.
CANCEL_STEPS = 3


@dataclass
class Liveness:
    """What the last heartbeat said, and when step progress was last seen."""
    heartbeat_at: float = 0.0
    steps: int = 0
    steps_changed_at: float = 0.0
    worker_state: str = "starting"
    active: int = 0
    waiting: int = 0
    active_bytes: int = 0
    peak_bytes: int = 0
    cache_bytes: int = 0                # MLX's buffer cache
    prompt_cache: CacheStats | None = None
    kv: KVStats | None = None           # the worker's KV memory (format, bytes per token)
    speculation: SpeculationStats | None = None
    load_progress: float | None = None
    progress: float | None = None       # the running request's (Heartbeat.progress)
    group_silence: float | None = None  # a group: s since its quietest rank was heard
    group_memory: tuple = ()            # a group: (rank, active, peak) of its other ranks

    def on_heartbeat(self, msg: Heartbeat, now: float) -> None:
        self.heartbeat_at = now
        if msg.steps != self.steps:
            self.steps, self.steps_changed_at = msg.steps, now
        self.worker_state, self.active, self.waiting = msg.state, msg.active, msg.waiting
        self.active_bytes, self.peak_bytes = msg.active_bytes, msg.peak_bytes
        self.cache_bytes = msg.cache_bytes
        self.prompt_cache = msg.prompt_cache
        self.kv = msg.kv
        self.speculation = msg.speculation
        self.load_progress = msg.load_progress
        self.progress = msg.progress
        self.group_silence = msg.group_silence
        self.group_memory = tuple(msg.group_memory)

    def verdict(self, now: float, config: Config, *, busy: bool,
                cancels: Iterable[tuple[float | None, int]],
                memory_limit: int | None = None,
                busy_since: float = 0.0) -> Verdict | None:
        """Why the worker must be killed now, or None. `busy`: it has requests and is
        serving (a worker still loading makes no steps and is not hung). `busy_since`:
        when it was last given work while it had none: the hang clock starts there, not
        at its last step before it went idle, which may be any time ago (an idle worker
        given work would otherwise be "hung" before it could take its first step).
        `cancels`: (when it was sent, the step count then) of each cancel sent and not
        answered. `memory_limit`: the MLX memory it may hold while idle (None: no limit)."""
        if now - self.heartbeat_at > config.heartbeat_timeout:
            return Verdict(ExitCause.HEARTBEAT, f"no heartbeat for {config.heartbeat_timeout:g} s")
        if self.group_silence is not None and self.group_silence > config.heartbeat_timeout:
            return Verdict(ExitCause.HEARTBEAT, f"a rank of the worker group sent no heartbeat "
                                                f"for {config.heartbeat_timeout:g} s")
        if busy and now - max(self.steps_changed_at, busy_since) > config.hang_timeout:
            return Verdict(ExitCause.HUNG,
                           f"hung: busy with no progress for {config.hang_timeout:g} s")
        for sent, steps_then in cancels:
            # The worker drops a cancelled sequence at its next step boundary: a cancel is
            # ignored once steps went by and the grace is over, not while one long step
            # (a prefill chunk on a slow machine) runs on; the hang check bounds that.
            if (sent is not None and now - sent > config.cancel_grace
                    and self.steps - steps_then >= CANCEL_STEPS):
                return Verdict(ExitCause.CANCEL,
                               f"cancel unanswered for {config.cancel_grace:g} s")
        if (memory_limit and not busy and self.worker_state == "ready"
                and self.held_bytes > memory_limit):
            return Verdict(ExitCause.MEMORY,
                           f"recycled: {self.held_bytes / 2**30:.2f} GiB of MLX memory "
                           f"({self.cache_bytes / 2**30:.2f} GiB of it buffer cache) held "
                           f"while idle, over its {memory_limit / 2**30:.2f} GiB limit")
        return None

    @property
    def held_bytes(self) -> int:
        """The MLX memory the worker holds: in use plus its buffer cache."""
        return self.active_bytes + self.cache_bytes
