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


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's default mutex deadlocks on relock")
def test_sigterm_ends_a_rank_stuck_in_c_with_the_groups_code(tmp_path):
    exit_file = tmp_path / "exit"
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE,
                            env={**os.environ, EXIT_FILE_ENV: str(exit_file)})
    try:
        assert proc.stdout.readline() == b"stuck\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == EXIT_GROUP_LOST
    finally:
        proc.kill()
        proc.wait()
    assert exit_file.read_text() == str(EXIT_GROUP_LOST)
