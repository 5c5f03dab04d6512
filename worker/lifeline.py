"""Die with the supervisor: a worker must never outlive the process that drives it.

An orphaned worker would hold gigabytes of (Metal) memory and its model with nobody to
serve, so this is installed first thing, before the model loads.

- Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)` has the kernel kill us when the parent dies.
  Caveat: the signal fires when the parent *thread* that forked us exits, so the
  supervisor must spawn workers from a long-lived thread (its event loop thread).
- macOS: a daemon thread waits on a kqueue for the parent's NOTE_EXIT.
- Elsewhere (or if those fail): a daemon thread polls getppid().
In every case we then re-check the parent pid: if the parent died before the watch was in
place we have already been re-parented (to init or a subreaper), and we exit at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("worker.lifeline")

PR_SET_PDEATHSIG = 1
POLL_INTERVAL = 0.5   # s; the portable fallback's check interval
EXIT_CODE = 70        # what a worker exits with when its parent is gone


def _die() -> None:
    # os._exit: no cleanup, no flushing of sockets nobody reads; just give memory back.
    os._exit(EXIT_CODE)


def _linux_pdeathsig() -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kqueue_watch(parent: int, die) -> bool:
    """Start a thread that calls `die` when `parent` exits (BSD/macOS kqueue)."""
    import select

    try:
        kq = select.kqueue()
        ev = select.kevent(parent, filter=select.KQ_FILTER_PROC,
                           flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT,
                           fflags=select.KQ_NOTE_EXIT)
        kq.control([ev], 0, 0)
    except ProcessLookupError:
        die()  # the parent is already gone
        return True
    except (OSError, AttributeError):
        return False

    def wait():
        while True:
            try:
                if kq.control(None, 1, None):
                    die()
                    return
            except InterruptedError:
                continue

    threading.Thread(target=wait, name="lifeline-kqueue", daemon=True).start()
    return True


def poll_parent(parent: int, getppid=os.getppid, die=_die, interval: float = POLL_INTERVAL,
                stop: threading.Event | None = None) -> None:
    """Loop until our parent pid changes (we were re-parented: the parent died), then die."""
    while stop is None or not stop.is_set():
        if getppid() != parent:
            die()
            return
        time.sleep(interval)


def install(expected_parent: int | None = None, *, platform: str = sys.platform,
            getppid=os.getppid, die=_die, pdeathsig=_linux_pdeathsig,
            kqueue_watch=_kqueue_watch, start_poller=True) -> str:
    """Arm the lifeline; return which mechanism is watching ("pdeathsig", "kqueue" or
    "poll"). The keyword arguments exist so tests can drive every branch."""
    parent = expected_parent if expected_parent is not None else getppid()
    mechanism = "poll"
    if platform.startswith("linux") and pdeathsig():
        mechanism = "pdeathsig"
    elif platform == "darwin" and kqueue_watch(parent, die):
        mechanism = "kqueue"
    # Close the race: the parent may have died before the watch was armed.
    if getppid() != parent:
        log.error("parent process %d is gone; exiting", parent)
        die()
        return mechanism
    if mechanism == "poll" and start_poller:
        threading.Thread(target=poll_parent, args=(parent, getppid, die), name="lifeline-poll",
                         daemon=True).start()
    log.debug("lifeline armed (%s) for parent %d", mechanism, parent)
    return mechanism
