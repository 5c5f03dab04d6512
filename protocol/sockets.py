"""ZeroMQ socket helpers: ipc:// endpoints in a private (0700) runtime directory.

Each worker incarnation gets two long-lived PUSH→PULL pairs: commands down, events up.
The supervisor binds both (it outlives workers); the worker connects. High-water marks
are off: the supervisor's admission control bounds queues, so ZMQ never drops or blocks.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

# AF_UNIX paths are short (104 bytes on macOS, 108 on Linux): keep the directory near /.
_MAX_IPC_PATH = 100


def make_runtime_dir() -> Path:
    """A fresh private directory for this supervisor's sockets (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR") if sys.platform.startswith("linux") else None
    if not base or not os.path.isdir(base) or len(base) > 60:
        base = tempfile.gettempdir()
        if len(base) > 60:
            base = "/tmp"
    path = Path(tempfile.mkdtemp(prefix="mlxd-", dir=base))  # mkdtemp makes it 0700
    os.chmod(path, 0o700)
    return path


def remove_runtime_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class Endpoints:
    commands: str  # supervisor PUSH binds, worker PULL connects
    events: str    # worker PUSH connects, supervisor PULL binds

    @classmethod
    def for_worker(cls, runtime_dir: Path, name: str) -> "Endpoints":
        cmd, evt = runtime_dir / f"{name}.cmd", runtime_dir / f"{name}.evt"
        if len(str(evt)) > _MAX_IPC_PATH:
            raise ValueError(f"socket path too long for AF_UNIX: {evt}")
        return cls(f"ipc://{cmd}", f"ipc://{evt}")


def configure(sock: zmq.Socket, *, linger_ms: int) -> zmq.Socket:
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # Linger bounds how long close() waits to flush: zero for commands to a worker that
    # may be dead; a little for events, so a worker's last Done still leaves on exit.
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


def push(ctx: zmq.Context, endpoint: str, *, bind: bool, linger_ms: int = 0) -> zmq.Socket:
    sock = configure(ctx.socket(zmq.PUSH), linger_ms=linger_ms)
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    return sock


def pull(ctx: zmq.Context, endpoint: str, *, bind: bool) -> zmq.Socket:
    sock = configure(ctx.socket(zmq.PULL), linger_ms=0)
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    return sock
