"""bench.gpu against a peer server that fails: a request the peer reset before answering
is sent again (mlx_lm.server's listen backlog of 5 resets some of 32 simultaneous
connections), only when asked (mlxd's requests never are), and a row whose peer failed
prints as failed with its reason while the other rows print as usual."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from bench.gpu import Peer, PeerFailed, summarize
from bench.throughput import RESENT, stream_chat

SSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
       b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
       b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],'
       b'"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n')


def resetting_server(resets: int) -> int:
    """A port whose first `resets` connections are reset once their request arrived
    (unanswered, as the kernel does past a full accept queue); the next is answered."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        for k in range(resets + 1):
            conn, _ = lsock.accept()
            _read_request(conn)
            if k < resets:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                conn.sendall(SSE)
            conn.close()
        lsock.close()

    threading.Thread(target=serve, daemon=True).start()
    return lsock.getsockname()[1]


def _read_request(conn: socket.socket) -> None:
    """The whole request, headers and body: a socket closed with bytes still unread sends
    a reset instead of its answer's end (the answered connection must not)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)


def test_a_request_reset_unanswered_is_sent_again_only_when_asked():
    port = resetting_server(2)
    got = stream_chat(port, {"model": "m", "messages": []}, retries=3)
    assert got["text"] == "hi" and got["tokens"] == 1 and RESENT[port] == 2
    port = resetting_server(1)
    with pytest.raises(ConnectionError):
        stream_chat(port, {"model": "m", "messages": []})


def test_a_failed_peer_row_prints_its_reason_and_the_rest_print():
    with pytest.raises(PeerFailed, match="mlx_lm.server: ConnectionResetError"):
        Peer.call(lambda: stream_chat(resetting_server(1), {"messages": []}))
    m = {k: ([1.0, 1.1], [1.0, 1.2]) for k in
         ("decode", "b8", "prefill", "warm", "chat prefill", "lm cold", "lm warm")}
    m["decode"] = ([(0.1, 50.0)] * 2, [(0.1, 52.0)] * 2)
    failed = {"lm decode": "round 1: mlx_lm.server: ConnectionResetError: reset",
              "lm b8": "round 0: mlx_lm.server: RemoteDisconnected: closed"}
    rows = {name: (sides, verdict) for name, sides, verdict in
            summarize("tiny", m, [8], True, failed)}
    assert len(rows) == 10
    assert rows["tiny chat decode"] == (
        "mlx_lm.server failed", "FAILED round 1: mlx_lm.server: ConnectionResetError: reset")
    assert rows["tiny chat 8 streams"][1].startswith("FAILED round 0")
    assert rows["tiny chat cold 2K TTFT"][1].startswith("ratio ")
    assert rows["tiny 8 streams"][1].startswith("ratio ")
