"""The runner's states and why a worker ended, as values, with the legal moves in one table.

A runner (one model's worker, kept alive) is always in one `RunnerState`; `TRANSITIONS`
lists where each state may go, and `ModelRunner` moves only through `check`, so an
impossible move (a broken model turning ready, a stopped one draining) is a bug that
raises at once instead of a state /health would show wrongly forever.

`ExitCause` says why a worker process ended; the liveness monitor's verdicts carry one, the
restart counters and the metrics label are keyed by it, never by parsing log text.
Both are string-valued: /health, `mlxctl status` and the metrics show the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from protocol.exits import EXIT_BROKEN, EXIT_GROUP_LOST


class RunnerState(str, Enum):
    WAITING = "waiting"         # for the memory gate, before the first spawn
    STARTING = "starting"       # the first worker is loading
    READY = "ready"             # serving
    RESTARTING = "restarting"   # a worker died: backing off, or its successor is loading
    DRAINING = "draining"       # retiring: serving what it accepted, taking nothing new
    BROKEN = "broken"           # failed to load, or crashed too often: serves nothing
    STOPPED = "stopped"         # no worker, and none coming

    def __str__(self) -> str:
        return self.value


S = RunnerState
TRANSITIONS: dict[RunnerState, frozenset[RunnerState]] = {
    S.STOPPED: frozenset({S.WAITING, S.STARTING}),
    S.WAITING: frozenset({S.STARTING, S.STOPPED}),
    S.STARTING: frozenset({S.READY, S.DRAINING, S.RESTARTING, S.BROKEN, S.STOPPED}),
    S.READY: frozenset({S.DRAINING, S.RESTARTING, S.BROKEN, S.STOPPED}),
    S.RESTARTING: frozenset({S.READY, S.DRAINING, S.BROKEN, S.STOPPED}),
    S.DRAINING: frozenset({S.RESTARTING, S.BROKEN, S.STOPPED}),
    S.BROKEN: frozenset({S.STOPPED}),
}
SERVING = frozenset({S.READY, S.DRAINING})  # a worker is up and takes requests


class IllegalTransition(RuntimeError):
    pass


def check(old: RunnerState, new: RunnerState) -> RunnerState:
    """`new`, if the table allows moving there from `old` (staying put always is)."""
    if new is not old and new not in TRANSITIONS[old]:
        raise IllegalTransition(f"runner state {old} cannot become {new}")
    return new


class ExitCause(str, Enum):
    CRASH = "crash"             # it exited on its own, not asked to
    HEARTBEAT = "heartbeat"     # killed: no heartbeat within --heartbeat-timeout
    HUNG = "hung"               # killed: busy with no step progress within --hang-timeout
    CANCEL = "cancel"           # killed: a cancel unanswered past --cancel-grace
    KILLED = "killed"           # killed by the server itself (unload, swap, shutdown)
    ADMIN = "admin"             # mlxctl kill: respawned at once, not counted as a crash
    MEMORY = "memory"           # recycled between requests: its memory grew past its limit
    #                             (respawned at once, not counted as a crash)
    SPAWN = "spawn"             # the process could not even be started
    LOAD = "load"               # it reported that the model cannot be loaded
    UNHEALTHY = "unhealthy"     # it found itself unable to run a step and asked to be recycled

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Verdict:
    """Why a worker must end (or ended): the cause, and words for logs and /health."""
    cause: ExitCause
    reason: str

    def __str__(self) -> str:
        return self.reason


def exit_verdict(code: int | None) -> Verdict:
    """Why a worker ended that nobody here asked to end: by its exit code."""
    if code == EXIT_GROUP_LOST:
        return Verdict(ExitCause.CRASH, "the worker group lost a rank (or its link)")
    if code == EXIT_BROKEN:
        return Verdict(ExitCause.UNHEALTHY,
                       "the worker could not run a step after a request failed and was recycled")
    return Verdict(ExitCause.CRASH, f"exited with code {code}")
