"""A streamed POST read as server-sent events, for `mlxctl run`.

http.client rather than urllib: the connection object stays in hand, so a Ctrl-C while
a reply streams closes the socket, and the server, seeing its client gone, cancels the
generation (the supervisor cancels a request whose client disconnects). Stdlib only, like
the rest of mlxctl.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Iterable, Iterator

from mlxctl.connection import Failed, ServerDown


def parse_events(lines: Iterable[bytes]) -> Iterator[dict]:
    """The JSON `data:` payloads of an SSE body, in order, until `data: [DONE]`. Comments
    (`: ping`) and other fields are skipped; a multi-line data field is joined."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line or not data:
            continue
        payload, data = "\n".join(data), []
        if payload == "[DONE]":
            return
        yield json.loads(payload)
    if data and "\n".join(data) != "[DONE]":
        yield json.loads("\n".join(data))


class EventStream:
    """POST `body` to `url + path` and iterate its events; `close()` ends it (and the
    server's work on it) at any time, also from an interrupted iteration.

    Nothing is sent until the iteration begins: the server answers the status line only
    when the generation starts (after a queue wait, or a load on request), so that wait
    is part of the iteration, and a Ctrl-C during it reaches the caller's handler, which
    closes the connection, like one during the reply."""

    def __init__(self, base_url: str, path: str, body: dict, *, api_key: str | None = None,
                 timeout: float = 600.0):
        self.base_url, self.path, self.body = base_url, path, body
        parts = urllib.parse.urlsplit(base_url)
        conn_type = http.client.HTTPSConnection if parts.scheme == "https" else \
            http.client.HTTPConnection
        self.conn = conn_type(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
        self.target = parts.path.rstrip("/") + path
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        self.response: http.client.HTTPResponse | None = None
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self) -> http.client.HTTPResponse:
        try:
            self.conn.request("POST", self.target, json.dumps(self.body), self.headers)
            response = self.response = self.conn.getresponse()
        except (ConnectionError, OSError) as e:
            self.close()
            raise ServerDown(f"mlxd is not running at {self.base_url} ({e}); start it with "
                             "`mlxctl serve --model MODEL` or `mlxctl service start`") from None
        if response.status != 200:
            raw = response.read()
            self.close()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {}
            raise Failed(response.status, payload)
        return response

    def __iter__(self) -> Iterator[dict]:
        response = self._open()
        try:
            for event in parse_events(response):
                error = event.get("error")
                if isinstance(error, dict):   # an error after the stream began: its last event
                    raise Failed(500, event)
                yield event
        except (http.client.HTTPException, OSError) as e:
            # The connection broke mid-reply (the server went away): not a traceback.
            raise ServerDown(f"lost the connection to mlxd at {self.base_url} "
                             f"mid-reply ({e or type(e).__name__})") from None

    def close(self) -> None:
        # The response holds the socket once the server said `Connection: close`: both.
        if self.response is not None:
            self.response.close()
        self.conn.close()
