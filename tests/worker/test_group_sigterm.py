"""A group's leader leaves at once with the group's code on mlx.launch's SIGTERM (another
rank failed) even while its main thread is stuck in C, where no Python signal handler
runs: as in a ring collective whose peer died (the integration test
test_a_leader_blocked_in_a_collective_still_leaves_as_lost drives the real one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from protocol.exits import EXIT_GROUP_LOST
from worker.group.rank import EXIT_FILE_ENV

# The main thread waits in C with the GIL released and never returns to Python: a
# normal mutex locked twice by one thread (no signal ends that wait).
STUCK = f"""
import ctypes
from worker.group.rank import leave_on_sigterm

leave_on_sigterm({EXIT_GROUP_LOST})
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(128)
libc.pthread_mutex_init(mutex, None)
libc.pthread_mutex_lock(mutex)
print("stuck", flush=True)
libc.pthread_mutex_lock(mutex)
"""


def sigterm_once_there(script: str, word: bytes, exit_file) -> None:
    """Run `script`, SIGTERM it once it prints `word`: it must exit with the group's code
    and leave that code, whole, in `exit_file` (and nothing beside it)."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            env={**os.environ, EXIT_FILE_ENV: str(exit_file)})
    try:
        assert proc.stdout.readline() == word + b"\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == EXIT_GROUP_LOST
    finally:
        proc.kill()
        proc.wait()
    assert exit_file.read_text() == str(EXIT_GROUP_LOST)
    assert [p.name for p in exit_file.parent.iterdir()
            if p.name.startswith(exit_file.name + ".")] == []


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's default mutex deadlocks on relock")
def test_sigterm_ends_a_rank_stuck_in_c_with_the_groups_code(tmp_path):
    sigterm_once_there(STUCK, b"stuck", tmp_path / "exit")


class Exited(BaseException):
    """os._exit, made to return to the test."""


def test_the_sigterms_two_handlers_leave_once(monkeypatch):
    """One SIGTERM runs both handlers (Python's on the main thread, the watch thread's):
    the second must not record the code again while the first's exit is under way."""
    from worker.group import rank

    left = []
    monkeypatch.setattr(rank, "leave", lambda code: left.append(code) or code)
    monkeypatch.setattr(rank.os, "_exit", lambda code: (_ for _ in ()).throw(Exited(code)))
    handler = rank._Leave(EXIT_GROUP_LOST)
    with pytest.raises(Exited) as first:
        handler(signal.SIGTERM, None)
    assert first.value.args == (EXIT_GROUP_LOST,)
    assert handler(signal.SIGTERM, None) is None  # the other one: nothing to do
    assert left == [EXIT_GROUP_LOST]


def test_an_exit_interrupting_a_write_leaves_the_recorded_code_whole(tmp_path, monkeypatch):
    """The process may end while a thread writes the exit file (another thread's os._exit):
    the file then still holds the code recorded before, never an empty one (the launcher
    read that as no code at all, a crash)."""
    from worker.group import rank

    exit_file = tmp_path / "exit"
    monkeypatch.setenv(EXIT_FILE_ENV, str(exit_file))
    assert rank.leave(EXIT_GROUP_LOST) == EXIT_GROUP_LOST
    assert exit_file.read_text() == str(EXIT_GROUP_LOST)

    class Ending:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise Exited(0)  # the process ends here

    monkeypatch.setattr(rank, "open", Ending, raising=False)
    with pytest.raises(Exited):
        rank.leave(EXIT_GROUP_LOST)
    assert exit_file.read_text() == str(EXIT_GROUP_LOST)


IDLE = f"""
import time
from worker.group.rank import leave_on_sigterm

leave_on_sigterm({EXIT_GROUP_LOST})
print("idle", flush=True)
while True:
    time.sleep(0.01)
"""


def test_sigterm_ends_an_idle_rank_with_the_groups_code(tmp_path):
    """Idle in Python, both handlers run for the signal: one code, recorded whole."""
    for i in range(3):
        sigterm_once_there(IDLE, b"idle", tmp_path / f"exit{i}")
