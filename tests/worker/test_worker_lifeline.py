"""The lifeline's decisions with injected platform facts, and the real thing on this OS."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from worker import lifeline


class Died(Exception):
    pass


def die():
    raise Died()


def test_linux_uses_pdeathsig_and_passes_when_parent_is_there():
    armed = []
    got = lifeline.install(100, platform="linux", getppid=lambda: 100, die=die,
                           pdeathsig=lambda: armed.append(1) or True, start_poller=False)
    assert got == "pdeathsig" and armed == [1]


def test_parent_gone_before_arming_means_exit():
    # Re-parented to init between spawn and install: the death signal would never come.
    with pytest.raises(Died):
        lifeline.install(100, platform="linux", getppid=lambda: 1, die=die,
                         pdeathsig=lambda: True, start_poller=False)


def test_macos_uses_kqueue():
    watched = []
    got = lifeline.install(100, platform="darwin", getppid=lambda: 100, die=die,
                           kqueue_watch=lambda pid, d: watched.append(pid) or True,
                           start_poller=False)
    assert got == "kqueue" and watched == [100]


@pytest.mark.parametrize("platform,pdeathsig,kq", [("freebsd", True, True),
                                                  ("linux", False, True),
                                                  ("darwin", True, False)])
def test_falls_back_to_polling(platform, pdeathsig, kq):
    got = lifeline.install(100, platform=platform, getppid=lambda: 100, die=die,
                           pdeathsig=lambda: pdeathsig, kqueue_watch=lambda p, d: kq,
                           start_poller=False)
    assert got == "poll"


def test_default_expected_parent_is_the_current_parent():
    assert lifeline.install(None, platform="linux", getppid=lambda: 4242, die=die,
                            pdeathsig=lambda: True, start_poller=False) == "pdeathsig"


def test_poller_dies_when_parent_changes():
    ppids = iter([100, 100, 100, 1])
    calls = []
    lifeline.poll_parent(100, getppid=lambda: next(ppids), die=lambda: calls.append("died"),
                         interval=0)
    assert calls == ["died"]


def test_poller_stops_on_request_without_dying():
    stop, calls = threading.Event(), []
    t = threading.Thread(target=lifeline.poll_parent,
                         args=(100, lambda: 100, lambda: calls.append(1), 0.01, stop))
    t.start()
    time.sleep(0.05)
    stop.set()
    t.join(2)
    assert not t.is_alive() and calls == []


@pytest.mark.skipif(sys.platform != "darwin", reason="kqueue process watch is macOS/BSD")
def test_real_kqueue_watch_fires_on_exit():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    fired = threading.Event()
    assert lifeline._kqueue_watch(child.pid, fired.set)
    child.wait()
    assert fired.wait(2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")
def test_real_pdeathsig_is_armed_in_a_child():
    # Arm it in a child process (not in the test runner!) and read it back with prctl.
    code = ("import ctypes, signal, os; from worker import lifeline;"
            "assert lifeline._linux_pdeathsig();"
            "v = ctypes.c_int(); libc = ctypes.CDLL(None);"
            "assert libc.prctl(2, ctypes.byref(v), 0, 0, 0) == 0;"  # PR_GET_PDEATHSIG
            "print(v.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 9  # SIGKILL
