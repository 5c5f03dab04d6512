"""The pure parts of `mlxctl run` and `mlxctl top`: reading a message (multi-line
blocks, continued lines), the conversation a request carries, SSE parsing, and top's
screen from status readings at any width. (In a terminal: tests/integration/
test_mlxctl_tui.py.)"""

from __future__ import annotations

import pytest

import io

from mlxctl.chat import Conversation, Reply, command, interactive, prompt_of, read_message
from mlxctl.connection import Failed, ServerDown
from mlxctl.sse import parse_events
from mlxctl.top import _read, live_rates, render


def reader(*lines):
    it = iter(lines)
    seen = []

    def read(prompt):
        seen.append(prompt)
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read, seen


@pytest.mark.parametrize("lines,message,prompts", [
    (["hello"], "hello", [">>> "]),
    (['"""', "one", "two", '"""'], "one\ntwo", [">>> ", "... ", "... ", "... "]),
    (['"""first', 'last"""'], "first\nlast", [">>> ", "... "]),
    (['"""all in one"""'], "all in one", [">>> "]),
    (["a \\", "b \\", "c"], "a \nb \nc", [">>> ", "... ", "... "]),
    (['"""', "never closed"], "never closed", [">>> ", "... ", "... "]),   # then EOF
])
def test_read_message(lines, message, prompts):
    read, seen = reader(*lines)
    assert read_message(read) == message
    assert seen == prompts


def test_end_of_input_is_none():
    read, _ = reader()
    assert read_message(read) is None


def test_the_conversation_carries_the_system_prompt_and_every_turn():
    c = Conversation(system="Be brief.")
    assert c.messages("hi") == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    c.add("hi", "hello")
    c.system = "Be long."
    assert [m["content"] for m in c.messages("more")] == ["Be long.", "hi", "hello", "more"]
    c.clear()
    assert c.messages("x") == [{"role": "system", "content": "Be long."},
                               {"role": "user", "content": "x"}]
    assert Conversation().messages("x") == [{"role": "user", "content": "x"}]


def test_commands_change_the_conversation():
    c, out = Conversation(), io.StringIO()
    c.add("hi", "hello")
    assert not command(c, "/system", out) and out.getvalue() == "(no system prompt)\n"
    assert not command(c, "/system   Be brief. ", out) and c.system == "Be brief."
    assert not command(c, "/clear", out) and c.turns == [] and c.system == "Be brief."
    assert not command(c, "/system", out) and out.getvalue().endswith("Be brief.\n")
    assert not command(c, "/help", out) and "/bye" in out.getvalue()
    assert not command(c, "/nope", out) and out.getvalue().endswith("/help lists them\n")
    assert command(c, "/bye", out) and command(c, "/exit", out)


def test_prompt_of_arguments_and_stdin():
    assert prompt_of(["say", "hi"], None) == "say hi"
    assert prompt_of(["summarize"], "the file\n") == "summarize\n\nthe file\n"
    assert prompt_of([], "the file") == "the file"
    assert prompt_of(["q"], "  \n") == "q" and prompt_of([], "") == ""


class FakeChat:
    """Chat.ask's contract without a server: one scripted Reply per question."""
    model = "m"

    def __init__(self, *replies):
        self.replies, self.asked = list(replies), []
        self.out, self.err = io.StringIO(), io.StringIO()

    def ask(self, messages):
        self.asked.append(messages)
        return self.replies.pop(0)

    def stats(self, reply):
        return "stats"


def test_a_session_keeps_turns_stops_errors_and_interrupts_at_the_prompt():
    lines = iter(["one", KeyboardInterrupt, "two", "three", "four", "five", EOFError])

    def read(prompt):
        line = next(lines)
        if isinstance(line, type):
            raise line
        return line
    chat = FakeChat(Reply(text="1", shown=True),
                    Reply(text="2 so f", shown=True, stopped=True),        # Ctrl-C mid-reply
                    Reply(stopped=True),                                   # Ctrl-C while queued
                    Reply(error=Failed(404, {"error": {"message": "no such model"}})),
                    Reply(text="5", shown=True))
    conv = Conversation(system="S")
    assert interactive(chat, conv, read, verbose=True) == 0
    # The stopped reply stays as far as it got; the one stopped before a word, and the
    # failed one, are dropped with their questions.
    assert [m["content"] for m in chat.asked[-1]] == ["S", "one", "1", "two", "2 so f", "five"]
    assert [m["content"] for m in conv.turns] == ["one", "1", "two", "2 so f", "five", "5"]
    out, err = chat.out.getvalue(), chat.err.getvalue()
    assert "(/bye or Ctrl-D leaves)" in out and out.count("^C (reply stopped)") == 2
    assert err.splitlines() == ["stats", "stats", "stats", "mlxctl: no such model (HTTP 404)",
                                "stats"]


def test_top_says_the_server_is_unreachable():
    class Down:
        url = "http://127.0.0.1:9"

        def call(self, *a, **k):
            raise ServerDown("mlxd is not running at http://127.0.0.1:9 ([Errno 111] "
                             "Connection refused); start it with ...")
    status, error = _read(Down())
    assert status is None
    assert render(status, {}, 200, error)[0] == (
        "server not reachable at http://127.0.0.1:9 ([Errno 111] Connection refused); retrying")


def test_parse_events():
    body = [b": ping\n", b"\n", b'data: {"a": 1}\n', b"\n", b"event: x\n", b'data: {"b":\n',
            b'data: 2}\n', b"\r\n", b"data: [DONE]\n", b"\n", b'data: {"after": 1}\n', b"\n"]
    assert list(parse_events(body)) == [{"a": 1}, {"b": 2}]
    assert list(parse_events([b'data: {"last": true}'])) == [{"last": True}]


def status(tokens_total=0, **w):
    worker = {"model": "org/model", "kind": "text", "state": "ready", "queued": 0,
              "waiting": 2, "in_flight": 1, "worker_active": 3, "slots": 8,
              "tokens_per_s": 12.5, "tokens_total": tokens_total, "active_bytes": 3 << 30,
              "peak_bytes": 4 << 30, "rss_bytes": 5 << 30, "restarts": 1,
              "prompt_cache": {"hits": 3, "misses": 1}, **w}
    return {"status": "ok", "server": {"uptime_s": 3723},
            "memory": {"available_bytes": 8 << 30, "total_bytes": 16 << 30, "pressure": "warn"},
            "workers": [worker]}


def test_top_screen_from_two_readings():
    rates = live_rates(status(100), status(400), 2.0)
    assert rates == {"org/model": 150.0}
    lines = render(status(400), rates, 200)
    head, _, header, row = lines[:4]
    assert head.startswith("mlxd ok  up 1h02m") and "8.0 GiB free of 16.0 GiB" in head
    assert "pressure warn" in head and "running 1" in head and "tok/s 150.0" in head
    for column in ("MODEL", "KIND", "STATE", "QUEUE", "BATCH", "TOK/S", "1M", "MLX ACTIVE",
                   "MLX PEAK", "RSS", "CACHE HIT", "RESTARTS"):
        assert column in header
    assert row.split() == ["org/model", "text", "ready", "2", "3/8", "150.0", "12.5",
                           "3.0", "GiB", "4.0", "GiB", "5.0", "GiB", "75%", "1"]
    assert lines[-1] == "q quits"


def test_top_without_a_first_reading_progress_and_narrow_screens():
    lines = render(status(7, state="starting", load_progress=0.4), {}, 200)
    assert "starting(40%)" in lines[3] and lines[3].split()[5] == "-"
    for width in (1, 10, 40):
        assert all(len(line) <= width for line in render(status(), {}, width))
    assert render(None, {}, 80, "connection refused")[0] == "connection refused; retrying"
    stale = render(status(), {}, 120, "timed out")
    assert "(last refresh failed: timed out; retrying)" in stale[1]
    assert "no model loaded" in render({**status(), "workers": []}, {}, 80)
