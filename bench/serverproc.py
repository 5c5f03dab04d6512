"""Start a real `mlxd` (supervisor + worker subprocesses) on a free port, for benchmarks
and integration tests.

It lives in bench/ because both need it and the dependency may only point one way: the
benchmarks run as `python -m bench.…` from the repository root and must not reach into
tests/ (test code is not a library), while tests may use this package like any other
module of the repository. tests/serverproc.py re-exports it under its old name.

What it starts it ends: `stop` ends mlxd and every process mlxd had started (its workers
run in sessions of their own, so no process group holds them all: the tree as psutil saw
it before the stop), and a server that does not become healthy is stopped before
`wait_healthy` raises (a fixture that fails in its setup gets no teardown: its mlxd would
outlive the test run).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running(p: psutil.Process) -> bool:
    """Still running: a zombie has ended (only its exit status waits for its parent)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running(procs: list[psutil.Process], wait: float = 0.0) -> list[psutil.Process]:
    """Those of `procs` still running after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        left = [p for p in procs if running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _ends_with_its_starter():
    """On Linux, what makes mlxd get SIGTERM when the process that started it dies: a
    killed pytest or benchmark otherwise leaves its servers running (their workers die
    with them by --parent-pid; mlxd itself has no parent to watch). Only from the main
    thread: the signal follows the starting thread, and a pool thread ends early. None
    elsewhere (macOS has no such call; there a killed run's servers stay up)."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def arm():
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    return arm


class ServerProcess:
    def __init__(self, models: list[str], *args: str, state_dir: Path | None = None,
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mlxd-test-")
            state_dir = Path(self._tmp.name)
        self.state_dir = state_dir
        self.log_path = state_dir / "server.stderr"
        argv = [sys.executable, "-m", "supervisor", "--port", str(self.port),
                "--state-dir", str(state_dir)]
        for m in models:
            argv += ["--model", m]
        argv += list(args)
        self._log = open(self.log_path, "wb")
        # Hermetic: an empty Hugging Face cache unless a test brings one, so /v1/models
        # lists only what the test made, whatever this machine has downloaded.
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1",
                    "HF_HUB_CACHE": str(state_dir / "hf-cache"), **(env or {})}
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, preexec_fn=_ends_with_its_starter())

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def wait_healthy(self, timeout: float = 120.0) -> dict:
        """/health's body once it says ok; else mlxd and what it started are stopped, and
        RuntimeError (it exited, or a model is broken: one that failed to load never
        recovers, and a traced bench's worker that could not load took the whole timeout
        to say so) or TimeoutError is raised with its log."""
        deadline = time.monotonic() + timeout
        last = None
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mlxd exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    code, body = self.get("/health", timeout=2)
                    last = body
                    if code == 200 and body.get("status") == "ok":
                        return body
                except (urllib.error.URLError, OSError, ValueError):
                    pass
                else:  # a model that failed to load stays broken: no use waiting on
                    broken = [w for w in body.get("workers", []) if w.get("state") == "broken"]
                    if broken:
                        raise RuntimeError(f"mlxd's model is broken: {broken}\n{self.log()}")
                time.sleep(0.1)
            raise TimeoutError(f"mlxd not healthy after {timeout}s: {last}\n{self.log()}")
        except BaseException:
            self.stop()
            raise

    def log(self, tail: int | None = 6000) -> str:
        """The server's stderr: its last `tail` characters (for a failure's message), or
        all of it (None: to count what it logged, which a tail's window would lose)."""
        try:
            text = self.log_path.read_text(errors="replace")
            return text[-tail:] if tail else text
        except OSError:
            return ""

    def worker_pids(self) -> list[int]:
        _, body = self.get("/health")
        return [w["pid"] for w in body.get("workers", []) if w.get("pid")]

    def descendants(self) -> list[psutil.Process]:
        """Every process mlxd started that is still its child (workers, a group's launcher,
        mlx.launch and its ranks)."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (mlxd stops its workers), SIGKILL after `timeout`; then what mlxd had
        started and left behind (it was killed, or a worker ignored it) is killed too."""
        started = self.descendants() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in still_running(started, wait=5.0):  # (their lifelines take a moment)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        still_running(started, wait=5.0)
        self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
