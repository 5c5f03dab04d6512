"""`GET /admin/logs?lines=N`: the last lines of the server's log, for the dashboard.

The log carries no prompt text unless the server was started with --log-prompts, and
the route sits behind the admin door (loopback and the admin token) like the rest of
/admin. Only the end of the file is read (`TAIL_BYTES` at most), in a thread: the log
may be 10 MiB before it rotates, and the dashboard asks every few seconds.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from aiohttp import web

from supervisor.http.errors import APIError
from supervisor.keys import CONFIG

MAX_LINES = 1000
TAIL_BYTES = 256 << 10


def tail_lines(path: Path, n: int, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last `n` lines of `path` found in its last `max_bytes` (fewer when lines are
    long; a cut first line is dropped). A missing file has no lines."""
    if n <= 0:
        return []
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]   # began mid-line
    return lines[-n:]


async def logs(request: web.Request) -> web.Response:
    raw = request.query.get("lines", "200")
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_LINES:
        raise APIError.bad_request(f"`lines` must be an integer from 0 to {MAX_LINES}.",
                                   "lines")
    path = request.app[CONFIG].logs() / "mlxd.log"
    lines = await asyncio.to_thread(tail_lines, path, n)
    return web.json_response({"file": str(path), "lines": lines})


def setup(router: web.UrlDispatcher, prefix: str) -> None:
    router.add_get(prefix + "/logs", logs)
