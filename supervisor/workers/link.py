"""The supervisor's side of one worker incarnation: the `WorkerLink` interface.

`ProcessLink` is the real one: a `python -m worker` subprocess and its two ZMQ
PUSH→PULL pairs. Tests substitute an in-process fake that speaks the same messages, so
the runner's fault handling (crash, hang, ignored cancel) is tested without MLX.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Callable

import zmq
import zmq.asyncio

from protocol import ProtocolError, decode_up, encode
from protocol.sockets import Endpoints, pull, push
from supervisor.workers import blas

log = logging.getLogger("mlxd.link")

# The drain's test as plain ints: pyzmq's POLLIN is an IntFlag, and `int & IntFlag` builds
# a flag object through enum's machinery on every test, twice a message (each a few µs:
# 7% of the supervisor's Python per streamed token, py-spy; issue 36).
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class LinkClosed(Exception):
    """The link's event stream has ended."""


class WorkerLink(abc.ABC):
    """One worker incarnation (`epoch`): send commands, receive events, watch the exit."""

    epoch: int
    pid: int | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Spawn the worker; returns once it runs (not once the model is loaded)."""

    @abc.abstractmethod
    def send(self, msg) -> None:
        """Queue a down message; never blocks."""

    @abc.abstractmethod
    async def recv(self) -> list:
        """The next up messages: at least one, and all others already waiting (one
        wake-up per burst, not per message). Raises LinkClosed once the link is closed."""

    @abc.abstractmethod
    async def wait(self) -> int:
        """Wait for the worker to exit; its exit code (negative: killed by signal)."""

    @abc.abstractmethod
    def terminate(self) -> None:
        """Ask the worker to stop (SIGTERM): it cancels what it runs and exits."""

    @abc.abstractmethod
    def kill(self) -> None:
        """SIGKILL: always safe, MLX state dies with the process."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets; call after the worker has exited."""

    def stderr_tail(self) -> list[str]:
        return []


LinkFactory = Callable[[int], WorkerLink]


class ProcessLink(WorkerLink):
    """A real worker subprocess speaking the protocol over ipc:// sockets."""

    STDERR_LINES = 50
    MAX_LINE = 2000  # characters of one stderr line that reach the log

    def __init__(self, *, epoch: int, model: str, name: str, runtime_dir: Path,
                 ctx: zmq.asyncio.Context, worker_args: list[str],
                 python: str = sys.executable, hosts: Path | None = None,
                 state_dir: Path | None = None):
        """`hosts`: a hostfile: the worker is a group of processes (worker/group/), started
        by `python -m worker.group.launch` in a process group of its own, which is what
        `kill` kills; `state_dir` is where the group's keys are kept."""
        self.epoch = epoch
        self._model, self._name = model, name
        self._ctx = ctx
        self._python = python
        self._extra = worker_args
        self._hosts = hosts
        self._hosts_state_dir = state_dir
        self._endpoints = Endpoints.for_worker(runtime_dir, f"w{os.getpid()}-{name_slug(name)}-{epoch}")
        self._cmd: zmq.asyncio.Socket | None = None
        self._evt: zmq.asyncio.Socket | None = None
        self._evt_sync: zmq.Socket | None = None
        self._evt_fd: int | None = None    # its descriptor while the loop reads it
        self._frames: list[bytes] = []     # read by _on_readable, not yet decoded
        self._readable = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr = collections.deque(maxlen=self.STDERR_LINES)
        self._stderr_task: asyncio.Task | None = None

    async def start(self) -> None:
        # Bind before spawning: the worker's connects then always find a peer, and
        # commands sent before it connects wait in ZMQ's queue (high-water mark off).
        self._evt = pull(self._ctx, self._endpoints.events, bind=True)
        self._evt_sync = zmq.Socket.shadow(self._evt.underlying)  # same socket, sync calls
        self._loop = asyncio.get_running_loop()
        self._evt_fd = self._evt_sync.getsockopt(zmq.FD)
        self._loop.add_reader(self._evt_fd, self._on_readable)
        self._cmd = push(self._ctx, self._endpoints.commands, bind=True)
        worker = [self._python, "-m", "worker", "--model", self._model, "--name", self._name,
                  "--commands", self._endpoints.commands, "--events", self._endpoints.events,
                  "--epoch", str(self.epoch), *self._extra]
        if self._hosts is None:
            argv = [*worker, "--parent-pid", str(os.getpid())]
        else:  # the ranks' parent is mlx.launch; the launcher watches us
            argv = [self._python, "-m", "worker.group.launch", "--hostfile", str(self._hosts),
                    "--parent-pid", str(os.getpid()), "--exit-file", self._exit_file(),
                    "--state-dir", str(self._hosts_state_dir),
                    "--", *worker, "--group"]
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, **blas.preload(os.environ)},
            # Own session: a terminal's Ctrl-C reaches only the supervisor, which then
            # stops its workers in order. The worker still dies with us (PDEATHSIG/kqueue).
            start_new_session=True)
        self.pid = self._proc.pid
        self._stderr_task = asyncio.create_task(self._read_stderr())

    async def _read_stderr(self) -> None:
        """Log the worker's stderr line by line, each line cut at MAX_LINE. Read in chunks,
        not readline(): a line over asyncio's 64 KiB limit would end the reader, the pipe
        would fill, and the worker would block on its next write with heartbeats still
        flowing (a hang nothing notices)."""
        wlog = logging.getLogger(f"mlxd.worker.{self._name}")
        assert self._proc and self._proc.stderr
        try:
            async for line in stderr_lines(self._proc.stderr, self.MAX_LINE):
                self._stderr.append(line)
                wlog.info("%s", line)
        except Exception:  # never silently: a dead reader is how the pipe fills
            log.exception("reading worker %s's stderr failed", self._name)

    def send(self, msg) -> None:
        if self._cmd is None:
            raise LinkClosed("link not started")
        # PUSH with no high-water mark never blocks; NOBLOCK makes sure of it.
        self._cmd.send(encode(msg), zmq.NOBLOCK)

    async def recv(self) -> list:
        while True:
            if not self._frames:
                if self._evt is None or self._evt_fd is None:
                    raise LinkClosed("link closed")
                self._readable.clear()
                await self._readable.wait()
                continue
            frames, self._frames = self._frames, []
            msgs = []
            for frame in frames:
                try:
                    msgs.append(decode_up(frame))
                except ProtocolError as e:
                    log.warning("dropping a bad frame from worker %s: %s", self._name, e)
            if msgs:
                return msgs

    def _on_readable(self) -> None:
        """The event loop's reader on the events socket: takes every frame queued (ZMQ's
        descriptor is edge-triggered: drain until ZMQ says nothing is left). One reader for
        the link's life rather than pyzmq's awaitable recv, which adds and removes the
        descriptor and builds futures for every message: 40% less of the loop's time per
        message, and at a message every few tokens that was the supervisor's largest
        per-token cost."""
        sock = self._evt_sync
        try:
            while sock is not None and sock.getsockopt(_EVENTS) & _POLLIN:
                self._frames.append(sock.recv(zmq.NOBLOCK))
        except zmq.ZMQError:
            self._drop_reader()  # closed under us: recv() then raises LinkClosed
        if self._frames:
            self._readable.set()

    def _drop_reader(self) -> None:
        if self._evt_fd is not None:
            self._loop.remove_reader(self._evt_fd)
            self._evt_fd = None
        self._readable.set()  # a recv() waiting sees the link closed

    async def wait(self) -> int:
        assert self._proc is not None
        code = await self._proc.wait()
        if self._stderr_task:
            try:  # the pipe closes with the process; keep its last lines
                await asyncio.wait_for(self._stderr_task, 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        return code

    def _exit_file(self) -> str:
        return self._endpoints.events.removeprefix("ipc://") + ".exit"

    def _signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.returncode is None:
            try:
                if self._hosts is not None and sig == signal.SIGKILL:
                    os.killpg(self._proc.pid, sig)  # the launcher, mlx.launch, local ranks
                else:
                    self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        self._drop_reader()
        for sock in (self._cmd, self._evt):
            if sock is not None:
                sock.close(linger=0)
        self._cmd = self._evt = self._evt_sync = None
        for ep in (self._endpoints.commands, self._endpoints.events, self._exit_file()):
            try:
                os.unlink(ep.removeprefix("ipc://"))
            except OSError:
                pass

    def stderr_tail(self) -> list[str]:
        return list(self._stderr)


def name_slug(name: str) -> str:
    """A short filesystem-safe tag for socket names (AF_UNIX paths are short)."""
    keep = "".join(c if c.isalnum() else "-" for c in name.rsplit("/", 1)[-1])
    return keep[:16] or "model"


async def stderr_lines(stream: asyncio.StreamReader, max_line: int):
    """The stream's lines (decoded, right-stripped), each cut at `max_line` characters
    with a note of its full size; lines of any length, in bounded memory."""
    keep = max_line * 4  # bytes of one line held (UTF-8: at most 4 bytes a character)
    buf, dropped = b"", 0
    while chunk := await stream.read(1 << 16):
        buf += chunk
        while (end := buf.find(b"\n")) >= 0:
            line, buf = buf[:end], buf[end + 1:]
            yield _cut(line, dropped, max_line)
            dropped = 0
        if len(buf) > keep:  # a line longer than is kept: count the rest, drop it
            dropped += len(buf) - keep
            buf = buf[:keep]
    if buf or dropped:
        yield _cut(buf, dropped, max_line)


def _cut(line: bytes, dropped: int, max_line: int) -> str:
    text = line.decode("utf-8", "replace").rstrip()
    if len(text) > max_line or dropped:
        text = f"{text[:max_line]}… [line cut: {len(line) + dropped} bytes]"
    return text
