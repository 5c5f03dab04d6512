"""supervisor/workers/restarts.py: when an ended worker starts again, by the clock."""

from __future__ import annotations

import dataclasses

from supervisor.config import Config
from supervisor.workers.restarts import Restarts
from supervisor.workers.states import ExitCause

CONFIG = dataclasses.replace(Config(), restart_backoff=0.5, restart_backoff_max=3.0,
                             crash_window=60.0, crash_budget=3)


def test_crashes_back_off_doubling_to_the_cap_then_break_the_model_past_the_budget():
    r = Restarts(CONFIG)
    got = [r.after(ExitCause.CRASH, float(t), 0.0, "boom") for t in range(4)]
    assert [x.delay for x in got[:3]] == [0.5, 1.0, 2.0] and not any(x.broken for x in got[:3])
    assert got[3].broken == "crash loop: 4 crashes within 60 s; last: boom"
    assert r.total == 4 and r.causes == {"crash": 4}


def test_the_backoff_caps_and_starts_over_after_a_worker_stayed_ready_past_the_window():
    r = Restarts(dataclasses.replace(CONFIG, crash_budget=100))
    delays = [r.after(ExitCause.HUNG, 100.0 * t, 0.0, "").delay for t in range(5)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert r.after(ExitCause.HEARTBEAT, 600.0, 61.0, "").delay == 0.5  # was ready 61 s


def test_crashes_older_than_the_window_are_forgotten():
    r = Restarts(CONFIG)
    for t in (0.0, 1.0, 2.0):
        r.after(ExitCause.CRASH, t, 0.0, "")
    later = r.after(ExitCause.CRASH, 70.0, 0.0, "")  # the first three left the window
    assert later.crash and later.broken is None


def test_ends_that_were_asked_for_restart_at_once_and_never_break_the_model():
    r = Restarts(CONFIG)
    for t in range(10):
        then = r.after(ExitCause.ADMIN if t % 2 else ExitCause.MEMORY, float(t), 0.0, "")
        assert not then.crash and then.delay == 0 and then.broken is None
    assert r.total == 10 and r.causes == {"admin": 5, "memory": 5}
    assert r.after(ExitCause.CRASH, 10.0, 0.0, "").delay == 0.5  # no crash counted before
