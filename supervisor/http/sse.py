"""Server-sent events framing for the streaming endpoints.

OpenAI streams one JSON object per `data:` event, ends with `data: [DONE]`, and reports a
failure mid-stream as a final `data: {"error": {...}}` event (the SDK raises it as
APIError). Comments (`: ping`) keep proxies and clients from timing out a quiet stream
while a long prompt is prefilled.

This module imports nothing from the rest of the server (http/errors.py imports it).
"""

from __future__ import annotations

import json
from typing import Optional

from aiohttp import web

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
PING_INTERVAL_S = 15.0

STREAM_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass events through as they come
    "Connection": "keep-alive",
}


# Characters that SSE does not take for line ends but many client line splitters do
# (Python's str.splitlines, which httpx's iter_lines uses; U+2028/2029 in older JavaScript):
# written as JSON escapes, so every client sees one event as one line.
_LINE_LIKE = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


# One encoder for every event: json.dumps with any argument of its own builds a new
# JSONEncoder per call, and a stream encodes an event per worker message (issue 36).
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_event(obj, event: Optional[str] = None) -> bytes:
    """`data: <compact json>\\n\\n`, after `event: <name>\\n` when named (Anthropic's
    streams name every event). JSON escapes CR and LF inside strings, and the other
    characters some clients split lines on are escaped here, so one event is always one
    line; NaN is refused (not JSON)."""
    text = _JSON.encode(obj)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        text = text.translate(_LINE_LIKE)  # only inside strings: JSON has them nowhere else
    data = b"data: " + text.encode("utf-8") + b"\n\n"
    return data if event is None else b"event: " + event.encode("ascii") + b"\n" + data


def error_event(err) -> bytes:
    """An APIError (anything with `to_envelope()`) as the stream's last event."""
    return encode_event(err.to_envelope())


async def open_stream(request: web.BaseRequest, status: int = 200,
                      headers: Optional[dict] = None) -> web.StreamResponse:
    """Prepare (send the headers of) an SSE response. X-Request-ID is added by the app's
    prepare signal (supervisor.http.errors.install)."""
    resp = web.StreamResponse(status=status, headers={**STREAM_HEADERS, **(headers or {})})
    resp.content_type = "text/event-stream"
    resp.charset = "utf-8"
    await resp.prepare(request)
    return resp
