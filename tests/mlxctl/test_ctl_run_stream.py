"""`mlxctl run`'s request and stream against a scripted loopback server (raw sockets, so
a test decides exactly when the status line and each event go out): what is sent, what
is printed, errors as one line, and Ctrl-C, while the server has not answered yet
(queued, loading) as well as mid-reply, closing the connection (what makes the real
server cancel the generation) and leaving a reply rather than a KeyboardInterrupt."""

from __future__ import annotations

import io
import json
import signal
import socket
import threading

import pytest

from mlxctl.chat import DIM, Chat, Conversation, one_shot
from mlxctl.connection import ServerDown
from mlxctl.sse import EventStream

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def delta(**d) -> bytes:
    return event({"choices": [{"index": 0, "delta": d, "finish_reason": None}]})


class Scripted:
    """Accepts one connection, reads the request, plays `script(send)`, then waits for
    the client to close (`closed`)."""

    def __init__(self, script):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.script, self.request, self.headers = script, None, ""
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.sock.accept()
        conn.settimeout(10)
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            self.headers = head.decode()
            length = int(next(line.split(":")[1] for line in self.headers.split("\r\n")
                              if line.lower().startswith("content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            self.request = json.loads(body)
            self.script(conn.sendall)
            try:
                while conn.recv(65536):
                    pass
                self.closed.set()
            except ConnectionResetError:
                # Closed with our events still unread: the kernel resets rather than
                # ends the connection. Closed all the same.
                self.closed.set()
            except OSError:  # (a timeout: still open)
                pass

    def close(self):
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def serve():
    servers = []

    def start(script):
        servers.append(Scripted(script))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def ctrl_c(send):
    """The user's Ctrl-C: SIGINT to the main thread, where `ask` is blocked reading."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@pytest.fixture
def interruptible():
    """Ctrl-C's default handler (KeyboardInterrupt), as a terminal's mlxctl has it: a test
    run started in the background of a shell (`make test &`) ignores SIGINT."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def chat(srv, **kw) -> Chat:
    return Chat(srv.url, "org/m", api_key=kw.pop("api_key", None),
                options=kw.pop("options", {}), out=io.StringIO(), err=io.StringIO(), **kw)


def test_a_reply_streams_with_reasoning_dimmed_and_usage(serve):
    usage = {"prompt_tokens": 9, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 4}}
    srv = serve(lambda send: send(HEAD + b": ping\n\n" + delta(role="assistant")
                                  + delta(reasoning_content="hmm") + delta(content="Hel")
                                  + delta(content="lo") + event({"choices": [], "usage": usage})
                                  + b"data: [DONE]\n\n"))
    c = chat(srv, api_key="k1", options={"max_tokens": 5})
    reply = c.ask(Conversation(system="S").messages("hi"))
    assert reply.text == "Hello" and reply.usage == usage and not reply.stopped
    assert c.out.getvalue().startswith(DIM + "hmm") and c.out.getvalue().endswith("Hello")
    assert srv.request == {"model": "org/m", "stream": True, "max_tokens": 5,
                           "stream_options": {"include_usage": True},
                           "messages": [{"role": "system", "content": "S"},
                                        {"role": "user", "content": "hi"}]}
    assert srv.headers.startswith("POST /v1/chat/completions ")
    assert "Authorization: Bearer k1" in srv.headers
    stats = c.stats(reply)
    assert stats.startswith("prompt 9 tokens (4 cached), reply 3 tokens, TTFT ")
    assert stats.endswith(" tok/s")


def test_one_shot_prints_the_answer_only(serve):
    srv = serve(lambda send: send(HEAD + delta(reasoning_content="hmm") + delta(content="A")
                                  + b"data: [DONE]\n\n"))
    c = chat(srv, show_reasoning=False)
    assert one_shot(c, Conversation(), "q", verbose=False) == 0
    assert c.out.getvalue() == "A\n" and c.err.getvalue() == ""
    assert "Authorization" not in srv.headers


@pytest.mark.parametrize("script", [
    lambda send: ctrl_c(send),                                       # before the status line
    lambda send: (send(HEAD + delta(content="par") + delta(content="tial")), ctrl_c(send)),
], ids=["queued", "mid-reply"])
def test_ctrl_c_stops_the_reply_and_closes_the_connection(serve, script, interruptible):
    srv = serve(script)
    reply = chat(srv).ask([{"role": "user", "content": "q"}])
    assert reply.stopped and reply.text in ("", "partial")
    assert srv.closed.wait(5), "the connection stayed open: the server would go on"


def refusal(status: int, message: str):
    body = json.dumps({"error": {"message": message}}).encode()
    return lambda send: send(b"HTTP/1.1 %d x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % (status, len(body)) + body)


def test_errors_are_one_line_and_exit_1(serve):
    c = chat(serve(refusal(404, "The model `org/m` does not exist.")))
    assert one_shot(c, Conversation(), "q", verbose=True) == 1
    assert c.out.getvalue() == ""
    assert c.err.getvalue() == "mlxctl: The model `org/m` does not exist. (HTTP 404)\n"
    c = chat(serve(refusal(401, "Invalid API key.")))
    assert one_shot(c, Conversation(), "q", verbose=False) == 1
    assert c.err.getvalue() == ("mlxctl: Invalid API key. (HTTP 401; pass --api-key or set "
                                "MLXD_API_KEY)\n")
    # A failure after the reply began: the text so far, then the error's line.
    script = lambda send: send(HEAD + delta(content="so far")  # noqa: E731
                               + event({"error": {"message": "worker crashed"}}))
    srv = serve(script)
    reply = chat(srv).ask([])
    assert reply.error.status == 500 and reply.text == "so far"
    assert srv.closed.wait(2), "the connection stayed open"
    c = chat(serve(script))
    assert one_shot(c, Conversation(), "q", verbose=False) == 1
    assert c.out.getvalue() == "so far\n"
    assert c.err.getvalue() == "mlxctl: worker crashed (HTTP 500)\n"


def test_a_server_that_is_not_there_is_server_down():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(ServerDown):
        list(EventStream(f"http://127.0.0.1:{port}", "/v1/chat/completions", {}))
