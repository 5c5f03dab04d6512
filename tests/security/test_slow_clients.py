"""Slow and idle clients cannot hold a real mlxd (supervisor/http/serving.py): headers
trickled byte by byte are cut at --header-timeout, a body that does not arrive is a 408
at --body-timeout, and idle sockets beyond --max-connections are closed, oldest first, so
/health still answers at once."""

from __future__ import annotations

import collections
import socket
import time

import httpx
import pytest

from supervisor.http.serving import ConnectionCap
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def srv(tiny_model):
    with ServerProcess([str(tiny_model)], "--header-timeout", "1", "--body-timeout", "1",
                       "--max-connections", "40") as s:
        s.wait_healthy()
        yield s


def connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def closed_by_server(sock: socket.socket, within: float) -> float | None:
    """Seconds until the server closed `sock` (None: still open after `within`)."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < within:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


def test_trickled_headers_are_cut_at_the_header_timeout(srv):
    sock = connect(srv)
    t0 = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    closed = False
    while time.monotonic() - t0 < 6:  # one byte every 0.2 s, never a whole head
        try:
            sock.sendall(b"x")
        except OSError:
            closed = True
            break
        if closed_by_server(sock, 0.2) is not None:
            closed = True
            break
    assert closed and time.monotonic() - t0 < 4, "a slowloris kept its connection"
    sock.close()
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


def test_a_body_that_never_arrives_is_a_408(srv, tiny_model):
    sock = connect(srv)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{\"model\": ")
    sock.settimeout(5)
    t0 = time.monotonic()
    head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert b"request_timeout" in head or b"request_timeout" in sock.recv(4096)
    assert time.monotonic() - t0 < 4
    sock.close()


def test_idle_sockets_beyond_the_cap_are_closed_and_health_answers(srv):
    socks = [connect(srv) for _ in range(300)]  # hundreds of idle sockets
    try:
        t0 = time.monotonic()
        r = httpx.get(srv.url + "/health", timeout=5)
        assert r.status_code == 200 and time.monotonic() - t0 < 1.0
        time.sleep(0.3)
        shut = sum(closed_by_server(s, 0.02) is not None for s in socks[:200])
        assert shut >= 150  # the oldest went first, to keep within 40
    finally:
        for s in socks:
            s.close()


class FakeHandler:
    def __init__(self, name):
        self.name, self.closed = name, False

    def force_close(self):
        self.closed = True


def test_the_cap_closes_the_longest_idle_then_refuses_when_all_are_busy():
    busy = collections.Counter()
    cap = ConnectionCap(2, busy)
    a, b, c, d = (FakeHandler(n) for n in "abcd")
    for h in (a, b):
        cap.open[h] = None
        cap.admit(h)
    assert not a.closed and not b.closed
    busy[a] += 1                  # a serves a request: b is the idle one
    cap.open[c] = None
    cap.admit(c)
    assert b.closed and not a.closed and not c.closed and cap.closed_idle == 1
    busy[c] += 1                  # all busy: the newcomer is refused
    cap.open[d] = None
    cap.admit(d)
    assert d.closed and not a.closed and not c.closed and cap.refused == 1
    assert list(cap.open) == [a, c]
