"""Anthropic's error envelope: `{"type": "error", "error": {"type", "message"},
"request_id"}`, with its error type names by status, for responses and for the `error`
event that ends a stream. The status (and Retry-After) stay what the server decided:
Anthropic's SDK retries on 408, 409, 429 and 5xx by the status, as OpenAI's does. The type
names are those the SDK's ErrorResponse knows (a 413 is an `invalid_request_error` there:
the documentation's `request_too_large` is not one of them). A prompt over the model's
context is worded as Anthropic words it ("prompt is too long: N tokens > M maximum")."""

from __future__ import annotations

import re

from aiohttp import web

from supervisor.http import sse
from supervisor.http.errors import APIError, Envelope

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
         504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


# The codes Anthropic's API gives in `error.details.error_code`, where its SDK reads them
# (a thread's: threads.py); the others are mlxd's own and stay out of its envelope.
DETAILED = frozenset({"thread_not_found", "thread_already_continued",
                      "thread_continue_in_flight"})


def envelope(err: APIError, request_id: str) -> dict:
    error = {"type": error_type(err.status), "message": message(err)}
    if err.code in DETAILED:
        error["details"] = {"error_code": err.code}
    return {"type": "error", "error": error, "request_id": request_id}


# How the server words a prompt over the context (worker/text/engine.py), and how
# Anthropic's API words it: Claude Code reads the two numbers out of the latter to compact
# the conversation and retry (its reactive compaction).
_OURS = re.compile(r"maximum context length is (\d+) tokens\. However, (?:the messages "
                   r"resulted in|you requested) (?:at least )?(\d+) tokens")


def message(err: APIError) -> str:
    found = _OURS.search(err.message) if err.code == "context_length_exceeded" else None
    if found is None:
        return err.message
    return f"prompt is too long: {found[2]} tokens > {found[1]} maximum"


class AnthropicEnvelope(Envelope):
    def response(self, err: APIError, request_id: str) -> web.Response:
        return web.json_response(envelope(err, request_id), status=err.status,
                                 headers={**err.headers, "request-id": request_id})

    def event(self, err: APIError, request_id: str) -> bytes:
        return sse.encode_event(envelope(err, request_id), event="error")
