"""The test side of a worker: it plays the supervisor on real ZMQ sockets.

Shared by the worker tests and fixtures (tests/worker/conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

from protocol import decode_up, encode, sockets

REPO = Path(__file__).resolve().parents[2]


class WorkerProc:
    """The test plays the supervisor: it binds both sockets and spawns the worker."""

    def __init__(self, model, state_dir, *extra, epoch: int = 1, name: str = "w",
                 env: dict | None = None):
        self.runtime = sockets.make_runtime_dir()
        self.endpoints = sockets.Endpoints.for_worker(self.runtime, name)
        self.ctx = zmq.Context()
        self.cmd = sockets.push(self.ctx, self.endpoints.commands, bind=True)
        self.evt = sockets.pull(self.ctx, self.endpoints.events, bind=True)
        self.epoch = epoch
        self.argv = [sys.executable, "-m", "worker", "--model", str(model),
                     "--commands", self.endpoints.commands, "--events", self.endpoints.events,
                     "--epoch", str(epoch), "--state-dir", str(state_dir),
                     # One Delta per token: the tests count them.
                     "--stream-interval", "0", *map(str, extra)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        # stderr to a file, not a pipe nobody drains (a full pipe would block the worker).
        self.stderr_path = self.runtime / "stderr.log"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stderr=err)
        self.heartbeats = []
        # Other requests' events that `collect` read while it waited for its own: the
        # worker prepares two requests at once, so two requests' events may come in
        # either order, and the next `collect` (or `recv`) gets them first.
        self.later: list = []

    def send(self, msg) -> None:
        self.cmd.send(msg if isinstance(msg, bytes) else encode(msg))

    def recv(self, timeout: float = 10.0, heartbeats: bool = False):
        """The next event (heartbeats are collected aside unless asked for); those
        `collect` kept aside first."""
        if self.later:
            return self.later.pop(0)
        return self._recv(timeout, heartbeats)

    def _recv(self, timeout: float, heartbeats: bool = False):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.evt.poll(int(left * 1000)):
                raise TimeoutError(f"no event within {timeout}s; worker rc={self.proc.poll()}"
                                   f"\n{self.dump_stacks()}")
            msg = decode_up(self.evt.recv())
            assert msg.epoch == self.epoch
            if msg.kind == "heartbeat" and not heartbeats:
                self.heartbeats.append(msg)
                continue
            return msg

    def wait_for(self, kind: str, timeout: float = 20.0, rid: str | None = None):
        """Skip events until one of `kind` (for `rid`) arrives; return (it, skipped)."""
        skipped = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if msg.kind == kind and (rid is None or getattr(msg, "rid", None) == rid):
                return msg, skipped
            skipped.append(msg)

    def collect(self, rid: str, timeout: float = 20.0) -> list:
        """All events of `rid` up to and including its Done; other requests' events
        are kept for later (`later`), anything else is skipped."""
        out = [m for m in self.later if getattr(m, "rid", None) == rid]
        self.later = [m for m in self.later if getattr(m, "rid", None) != rid]
        if out and out[-1].kind == "done":
            return out
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(max(0.01, deadline - time.monotonic()))
            if getattr(msg, "rid", None) == rid:
                out.append(msg)
                if msg.kind == "done":
                    return out
            elif getattr(msg, "rid", None):
                self.later.append(msg)

    def dump_stacks(self) -> str:
        """The worker's thread stacks (faulthandler on SIGUSR1) and its stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
        return self.stderr_text()[-6000:]

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.ctx.destroy(linger=0)
        sockets.remove_runtime_dir(self.runtime)
