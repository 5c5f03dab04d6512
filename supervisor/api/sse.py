"""Server-sent events framing for the streaming endpoints.

OpenAI streams one JSON object per `data:` event, ends with `data: [DONE]`, and reports a
failure mid-stream as a final `data: {"error": {...}}` event (the SDK raises it as
APIError). Comments (`: ping`) keep proxies and clients from timing out a quiet stream
while a long prompt is prefilled.

This module imports nothing from the rest of the server (errors.py imports it).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Optional

from aiohttp import web

if TYPE_CHECKING:
    from supervisor.errors import APIError

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
PING_INTERVAL_S = 15.0

STREAM_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass events through as they come
    "Connection": "keep-alive",
}


def encode_event(obj) -> bytes:
    """`data: <compact json>\\n\\n`. JSON escapes CR and LF inside strings, so one event is
    always one line; NaN is refused (not JSON)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return b"data: " + text.encode("utf-8") + b"\n\n"


def error_event(err: "APIError") -> bytes:
    return encode_event(err.to_envelope())


async def open_stream(request: web.BaseRequest, status: int = 200,
                      headers: Optional[dict] = None) -> web.StreamResponse:
    """Prepare (send the headers of) an SSE response. X-Request-ID is added by the app's
    prepare signal (supervisor.errors.install)."""
    resp = web.StreamResponse(status=status, headers={**STREAM_HEADERS, **(headers or {})})
    resp.content_type = "text/event-stream"
    resp.charset = "utf-8"
    await resp.prepare(request)
    return resp


class EventStream:
    """Writes to a prepared SSE response, with a `: ping` whenever nothing was written for
    `ping_interval` seconds. All writes go through one lock, so a ping never lands inside
    another write. Use as `async with EventStream(resp) as events: await events.send(...)`.

    A failed ping (client gone) just stops the pinger: the handler learns of the disconnect
    from its own next write, or is cancelled by aiohttp (handler_cancellation)."""

    def __init__(self, response: web.StreamResponse,
                 ping_interval: float = PING_INTERVAL_S) -> None:
        self.response = response
        self.ping_interval = ping_interval
        self._lock = asyncio.Lock()
        self._last_write = time.monotonic()
        self._pinger: Optional[asyncio.Task] = None

    async def __aenter__(self) -> "EventStream":
        self._last_write = time.monotonic()
        if self.ping_interval and self.ping_interval > 0:
            self._pinger = asyncio.create_task(self._ping_loop())
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop_pinging()

    async def send(self, data: bytes) -> None:
        async with self._lock:
            await self.response.write(data)
            self._last_write = time.monotonic()

    async def send_event(self, obj) -> None:
        await self.send(encode_event(obj))

    async def send_error(self, err: "APIError") -> None:
        await self.send(error_event(err))

    async def send_done(self) -> None:
        await self.send(DONE)

    async def stop_pinging(self) -> None:
        task, self._pinger = self._pinger, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                # Our own cancel of the pinger; re-raise only if *we* are being cancelled.
                cur = asyncio.current_task()
                if cur is not None and cur.cancelling():
                    raise

    async def _ping_loop(self) -> None:
        while True:
            quiet_for = time.monotonic() - self._last_write
            if quiet_for < self.ping_interval:
                await asyncio.sleep(self.ping_interval - quiet_for)
                continue
            try:
                await self.send(PING)
            except Exception:
                return
