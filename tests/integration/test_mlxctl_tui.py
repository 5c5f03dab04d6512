"""`mlxctl run` and `mlxctl top` on a real server, driven in tmux as a person would
(send-keys, capture-pane): a conversation with /system, /clear, a multi-line message and
Ctrl-C stopping a reply (the server stops generating; the session goes on); top's live
screen and `q`. Plus the plain forms scripts use: one-shot and piped `run`, `top` not on
a terminal. The tiny model's words mean nothing: the assertions are about structure."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.integration.test_mlxctl import mlxctl
from tests.serverproc import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def need_tmux():
    if shutil.which("tmux") is None:
        if os.environ.get("MLXD_REQUIRE_UI_TOOLS") == "1":
            pytest.fail("tmux is not installed and MLXD_REQUIRE_UI_TOOLS=1")
        pytest.skip("tmux is not installed (apt install tmux)")


class Tmux:
    """A program in its own tmux server (its own socket: nothing shared with a user's)."""

    def __init__(self, argv: list[str], width: int = 160, height: int = 50):
        self.socket = f"mlxd-test-{uuid.uuid4().hex[:8]}"
        cmd = " ".join(shlex.quote(a) for a in argv)
        self.tmux("new-session", "-d", "-x", str(width), "-y", str(height), "-c", str(REPO), cmd)
        self.path = self.tmux("display-message", "-p", "#{socket_path}").stdout.strip()

    def tmux(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                              text=True, timeout=10)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-l", text)
        self.tmux("send-keys", "Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-500").stdout

    def alive(self) -> bool:
        return self.tmux("has-session").returncode == 0

    def wait(self, predicate, what: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; the screen:\n{self.screen()}")

    def ended(self, timeout: float = 10.0) -> bool:
        """The program exited (its session with it) within `timeout`."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return not self.alive()

    def close(self) -> None:
        self.tmux("kill-server")
        if self.path:   # tmux leaves its socket file behind
            Path(self.path).unlink(missing_ok=True)


def ctl_argv(server, *args) -> list[str]:
    return [sys.executable, "-m", "mlxctl.client", "--url", server.url,
            "--state-dir", str(server.state_dir), *args]


def prompts(screen: str) -> int:
    return len(re.findall(r"^>>> ", screen, re.M))


def at_prompt(n: int):
    """The screen's n-th `>>> ` prompt is up, and is the last line."""
    return lambda s: prompts(s) >= n and s.rstrip().splitlines()[-1].startswith(">>>")


def in_flight(server) -> int:
    return sum(w["in_flight"] for w in httpx.get(server.url + "/health", timeout=10).json()["workers"])


def test_a_conversation_with_commands_and_a_multi_line_message(server, model_id):
    t = Tmux(ctl_argv(server, "run", model_id, "--max-tokens", "6", "--verbose"))
    try:
        t.wait(at_prompt(1), "the first prompt")
        t.type("hello there")
        s = t.wait(at_prompt(2), "the reply and the next prompt")
        assert s.count("reply 6 tokens") == 1 or s.count(" tokens, TTFT ") == 1
        t.type("/system Be brief.")
        t.wait(lambda s: "(system prompt set)" in s, "/system")
        t.type("/system")
        t.wait(lambda s: re.search(r"^Be brief\.$", s, re.M), "/system showing it")
        t.type('"""')
        t.type("first line")
        t.type('second line"""')
        s = t.wait(at_prompt(5), "the multi-line message's reply")
        assert "... first line" in s and " tokens, TTFT " in s
        assert s.count(" tokens, TTFT ") == 2
        # The second request carried the whole conversation: the first turn was cached.
        cached = [int(c) for c in re.findall(r"\((\d+) cached\)", s)]
        assert cached[-1] > 0, s
        t.type("/clear")
        t.wait(lambda s: "(conversation cleared)" in s, "/clear")
        t.keys("C-c")                      # at the prompt: only the line goes
        t.wait(lambda s: "(/bye or Ctrl-D leaves)" in s, "Ctrl-C at the prompt")
        assert t.alive()
        t.type("/bye")
        assert t.ended(), "/bye did not end mlxctl run"
    finally:
        t.close()


def test_ctrl_c_stops_the_reply_and_not_the_session(server, model_id):
    # Greedy: at temperature 1 the tiny model can sample its EOS and end the reply on its
    # own before the Ctrl-C lands (then the Ctrl-C meets the prompt); greedy never picks it.
    t = Tmux(ctl_argv(server, "run", model_id, "--max-tokens", "3000", "--temperature", "0"))
    try:
        t.wait(at_prompt(1), "the first prompt")
        for turn in (2, 3):
            t.type("tell me everything")
            deadline = time.monotonic() + 30
            while in_flight(server) == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.05)
            # Some of the reply is on screen (a Ctrl-C before mlxctl prints any is another
            # case: under load a fixed pause was not always enough).
            t.wait(lambda s: not s.rstrip().endswith("tell me everything"), "the reply")
            t.keys("C-c")
            t.wait(at_prompt(turn), "the prompt after Ctrl-C")
            deadline = time.monotonic() + 10
            while in_flight(server):
                assert time.monotonic() < deadline, "the server kept generating"
                time.sleep(0.05)
        s = t.screen()
        assert s.count("^C (reply stopped)") == 2
        t.keys("C-d")                       # at an empty prompt: leave
        assert t.ended(), "Ctrl-D did not end mlxctl run"
    finally:
        t.close()


def row_of(screen: str, model: str) -> list[str]:
    line = next(l for l in screen.splitlines() if l.startswith(model))
    return line[len(model):].split()


def test_top_updates_live_and_quits_on_q(server, model_id):
    t = Tmux(ctl_argv(server, "top", "--interval", "0.3"), width=220)
    try:
        s = t.wait(lambda s: model_id in s and "ready" in s, "the model's row")
        assert "MODEL" in s and "TOK/S" in s and "MLX ACTIVE" in s and "q quits" in s
        header = s.splitlines()[0]
        assert header.startswith("mlxd ok") and "memory" in header
        # While a long request runs, the live tokens/s (between two refreshes) moves.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            done = pool.submit(httpx.post, server.url + "/v1/completions", timeout=120, json={
                "model": model_id, "prompt": "count", "max_tokens": 2000,
                "temperature": 0})
            # The batch holds it, then the rate between two refreshes shows its tokens
            # (that rate covers the last interval: the request may be over by then).
            t.wait(lambda s: row_of(s, model_id)[3] == "1/8", "the batch to hold it", 30)
            t.wait(lambda s: row_of(s, model_id)[4] not in ("-", "0.0"), "live tokens/s", 30)
            assert done.result().status_code == 200
        t.keys("q")
        assert t.ended(), "q did not quit top"
    finally:
        t.close()


class StatusOnly(http.server.BaseHTTPRequestHandler):
    """/admin/status of a server with one model, and nothing else: what top reads."""
    STATUS = {"status": "ok", "server": {"uptime_s": 5},
              "memory": {"available_bytes": 8 << 30, "total_bytes": 16 << 30},
              "workers": [{"model": "org/fake", "kind": "text", "state": "ready", "waiting": 0,
                           "in_flight": 0, "worker_active": 0, "slots": 8, "tokens_total": 0,
                           "tokens_per_s": 0.0, "restarts": 0}]}

    def do_GET(self):
        body = json.dumps(self.STATUS).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_top_outlives_the_server_and_q_gives_the_terminal_back(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StatusOnly)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    top = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "mlxctl.client",
                                            "--url", url, "--state-dir", str(tmp_path), "top",
                                            "--interval", "0.2"])
    # In a shell, which prints top's exit status and keeps the pane once top is gone.
    t = Tmux(["sh", "-c", f"{top}; echo top-exited=$?; sleep 60"], width=200)
    try:
        t.wait(lambda s: "org/fake" in s and "ready" in s, "the fake server's row")
        httpd.shutdown()
        httpd.server_close()
        s = t.wait(lambda s: "server not reachable at " + url in s, "the lost server said")
        assert "retrying" in s and "org/fake" in s          # the last reading stays up
        time.sleep(0.5)                                     # more failed refreshes: no crash
        t.keys("q")
        s = t.wait(lambda s: "top-exited=0" in s, "top's exit")
        assert "q quits" not in s and "Traceback" not in s  # the shell's screen is back
    finally:
        t.close()
        httpd.server_close()


def test_one_shot_and_piped_run_and_top_off_a_terminal(server, model_id):
    out = mlxctl(server, "run", model_id, "say", "hi", "--max-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and ">>>" not in out.stdout and "Traceback" not in out.stderr
    piped = subprocess.run(ctl_argv(server, "run", model_id, "--max-tokens", "5"), cwd=REPO,
                           input="a question from a pipe\n", capture_output=True, text=True,
                           timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.strip() and ">>>" not in piped.stdout
    empty = subprocess.run(ctl_argv(server, "run", model_id), cwd=REPO, input="",
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "no prompt" in empty.stderr and empty.stdout == ""
    out = mlxctl(server, "top")            # stdout is a pipe: the table, once
    assert out.returncode == 0 and out.stdout.startswith("status: ok")
    assert model_id in out.stdout
    out = mlxctl(server, "run", "no/such-model", "hi")
    assert out.returncode == 1 and "Traceback" not in out.stderr
