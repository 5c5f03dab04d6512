"""Every failure the HTTP surface can report, as OpenAI's error envelope.

OpenAI clients (the official SDKs and everything modelled on them) read failures from one
shape: HTTP status + `{"error": {"message", "type", "param", "code"}}`, all four keys always
present. Retries are decided from the status (408/409/429/5xx) and `Retry-After`. So the
server raises `APIError` anywhere, and one middleware (`error_middleware`) turns it — and
aiohttp's own HTTP exceptions, and any bug — into that shape. The same middleware assigns
each request its `X-Request-ID`.

A surface whose clients read another shape registers an `Envelope` for its path prefix
(`add_envelope`: the Anthropic Messages API on /v1/messages), and every error under it,
mid-stream ones included, takes that shape instead.

Route handlers call: `APIError.<constructor>(...)`, `read_json(request)`,
`get_request_id(request)`; the app factory puts `error_middleware` first in its middlewares
and calls `install_request_id(app)` (or `install(app)` for both).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import uuid
from typing import Optional

from aiohttp import web

from supervisor.http.sse import error_event
from supervisor.workers import errors as werr
from supervisor.http.values import first_bad_value

log = logging.getLogger(__name__)

# Error `type` values. OpenAI uses invalid_request_error for every 4xx caused by the request
# and server_error for 5xx; clients branch on the status, not on these strings.
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# OpenAI's own wording for an unexpected failure: says nothing about our internals.
_INTERNAL_MESSAGE = (
    "The server had an error while processing your request. Sorry about that! "
    "Check the server log for the request id in the X-Request-ID header."
)


class Envelope:
    """How a surface whose clients read another error shape (Anthropic's) renders an
    APIError: a whole response, or the last event of a stream already under way."""

    def response(self, err: "APIError", request_id: str) -> web.Response:
        raise NotImplementedError

    def event(self, err: "APIError", request_id: str) -> bytes:
        raise NotImplementedError


# Path prefix → Envelope, for the surfaces that are not OpenAI's (the default).
ENVELOPES = web.AppKey("mlxd_envelopes", dict)


def add_envelope(app: web.Application, prefix: str, envelope: Envelope) -> None:
    """Errors on paths under `prefix` are rendered by `envelope`: the routes' own 404s,
    405s, 413s and bad JSON included, since the middleware renders them all."""
    if ENVELOPES not in app:
        app[ENVELOPES] = {}
    app[ENVELOPES][prefix] = envelope


def _envelope_of(request: web.BaseRequest) -> Optional[Envelope]:
    table = request.app.get(ENVELOPES) if request.app is not None else None
    for prefix, envelope in (table or {}).items():
        if request.path == prefix or request.path.startswith(prefix + "/"):
            return envelope
    return None


def _respond(request: web.BaseRequest, err: "APIError") -> web.Response:
    envelope = _envelope_of(request)
    if envelope is None:
        return err.to_response()
    return envelope.response(err, get_request_id(request))


class APIError(Exception):
    """An error to show to the client. Raise it anywhere under a route handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return (f"APIError({self.status}, {self.message!r}, type={self.type!r}, "
                f"param={self.param!r}, code={self.code!r})")

    def to_envelope(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def to_response(self) -> web.Response:
        return web.json_response(self.to_envelope(), status=self.status, headers=self.headers)

    # ---- constructors, one per case the server reports ------------------------------

    @classmethod
    def bad_request(cls, message: str, param: Optional[str] = None,
                    code: Optional[str] = None) -> "APIError":
        return cls(400, message, INVALID_REQUEST, param, code)

    @classmethod
    def model_not_found(cls, model: str) -> "APIError":
        # The name as sent, but bounded: a 5000-character name is not echoed back whole.
        shown = model if len(model) <= 256 else model[:256] + "…"
        return cls(404, f"The model `{shown}` does not exist or you do not have access to it.",
                   INVALID_REQUEST, "model", "model_not_found")

    @classmethod
    def context_length_exceeded(cls, message: str, param: Optional[str] = "messages") -> "APIError":
        return cls(400, message, INVALID_REQUEST, param, "context_length_exceeded")

    @classmethod
    def payload_too_large(cls, limit_bytes: int) -> "APIError":
        return cls(413, f"Request body too large: the limit is {limit_bytes} bytes.",
                   INVALID_REQUEST, None, "request_too_large")

    @classmethod
    def overloaded(cls, message: str = "The server is overloaded; please retry shortly.",
                   retry_after_s: float = 1.0) -> "APIError":
        # 503 + server_error is what OpenAI itself sends when its engines are overloaded
        # ("That model is currently overloaded with other requests"); the SDKs retry 503 and
        # honour Retry-After. (429 would read as the client's own rate limit.)
        return cls(503, message, SERVER_ERROR, None, "overloaded",
                   {"Retry-After": _retry_after(retry_after_s)})

    @classmethod
    def timeout(cls, message: str = "The request timed out.") -> "APIError":
        return cls(504, message, SERVER_ERROR, None, "timeout")

    @classmethod
    def worker_failed(cls, message: str = "The model worker failed while serving this "
                      "request; it is being restarted. Please retry.") -> "APIError":
        return cls(503, message, SERVER_ERROR, None, "worker_failed", {"Retry-After": "1"})

    @classmethod
    def insufficient_memory(cls, need_bytes: int, free_bytes: int) -> "APIError":
        # DESIGN.md, memory gate: 507 with how much is needed and how much is free.
        return cls(507, werr.InsufficientMemory(need_bytes, free_bytes).message,
                   SERVER_ERROR, None, "insufficient_memory")

    @classmethod
    def not_found(cls, path: str, method: Optional[str] = None) -> "APIError":
        # OpenAI's wording for an unknown route: "Invalid URL (POST /v1/foo)".
        where = f"{method} {path}" if method else path
        return cls(404, f"Invalid URL ({where})", INVALID_REQUEST, None, "not_found")

    @classmethod
    def method_not_allowed(cls, method: str, path: str, allowed=()) -> "APIError":
        allowed = sorted(allowed)
        headers = {"Allow": ",".join(allowed)} if allowed else {}
        return cls(405, f"Method {method} is not allowed for {path}"
                   + (f" (allowed: {', '.join(allowed)})." if allowed else "."),
                   INVALID_REQUEST, None, "method_not_allowed", headers)

    @classmethod
    def internal(cls, message: Optional[str] = None) -> "APIError":
        """500. Without a message, OpenAI's generic wording; pass one only if it is safe to
        show (never a traceback or exception text)."""
        return cls(500, message or _INTERNAL_MESSAGE, SERVER_ERROR, None, None)

    @classmethod
    def unauthorized(cls, message: str = "Missing or invalid API key.") -> "APIError":
        return cls(401, message, INVALID_REQUEST, None, "invalid_api_key",
                   {"WWW-Authenticate": "Bearer"})

    @classmethod
    def forbidden(cls, message: str = "You are not allowed to perform this request.") -> "APIError":
        return cls(403, message, INVALID_REQUEST, None, "forbidden")



def _retry_after(seconds: float) -> str:
    # Retry-After is whole seconds (RFC 9110); never 0, which reads as "hammer me".
    return str(max(1, math.ceil(seconds)))


def api_error(e: Exception) -> "APIError":
    """Worker management's domain errors (supervisor/workers/errors.py) as the OpenAI
    envelope: the one place that decides their statuses. An APIError passes through."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, werr.BadRequest):
        return APIError(400, e.message, INVALID_REQUEST, e.param, e.code)
    if isinstance(e, werr.ModelNotFound):
        return APIError.model_not_found(e.model)
    if isinstance(e, werr.Overloaded):
        return APIError.overloaded(e.message, e.retry_after_s)
    if isinstance(e, werr.WorkerFailed):
        return APIError.worker_failed(e.message)
    if isinstance(e, werr.LoadFailed):
        return APIError(503, e.message, SERVER_ERROR, None, "model_load_failed")
    if isinstance(e, werr.InsufficientMemory):
        return APIError.insufficient_memory(e.need_bytes, e.free_bytes)
    if isinstance(e, werr.RequestTimeout):
        return APIError.timeout(e.message)
    if isinstance(e, werr.Internal):
        return APIError.internal(e.message or None)
    return APIError.internal()


# ---- request ids ---------------------------------------------------------------------

REQUEST_ID = web.RequestKey("request_id", str)
# The response the handler prepared, recorded by the prepare signal: tells the middleware
# whether headers already went out (then an envelope can no longer be sent).
_PREPARED = web.RequestKey("mlxd_prepared_response", web.StreamResponse)
_SANE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def get_request_id(request: web.BaseRequest) -> str:
    """The request's id: the client's `X-Request-ID` when it is a sane token (so a caller
    can correlate its own logs), otherwise a fresh uuid4 hex. Made once, then stored."""
    rid = request.get(REQUEST_ID)
    if rid is None:
        given = request.headers.get("X-Request-ID", "")
        rid = given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        request[REQUEST_ID] = rid
    return rid


async def _on_response_prepare(request: web.BaseRequest, response: web.StreamResponse) -> None:
    # One place for every response: plain, streaming (prepared inside the handler) and the
    # error responses the middleware builds.
    response.headers.setdefault("X-Request-ID", get_request_id(request))
    request[_PREPARED] = response


# ---- the middleware ------------------------------------------------------------------

@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """APIError, aiohttp HTTP errors and any other exception → the JSON envelope. Also
    assigns the request id first, so every log line of the request can carry it."""
    get_request_id(request)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise  # the client left (handler_cancellation): nothing to answer
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like are not errors
        err = _from_http_exception(request, exc)
        started = _started(request)
        if started is not None:
            return await _fail_started(request, started, exc, err)
        log.debug("request %s: %s %s -> %s", request[REQUEST_ID], request.method,
                  request.path, exc.status)
        return _respond(request, err)
    except (APIError, werr.WorkerError) as exc:
        err = api_error(exc)
        started = _started(request)
        if started is not None:
            return await _fail_started(request, started, err, err)
        level = logging.WARNING if err.status >= 500 else logging.DEBUG
        log.log(level, "request %s: %s %s -> %s %s", request[REQUEST_ID], request.method,
                request.path, err.status, err.message)
        return _respond(request, err)
    except Exception as exc:
        started = _started(request)
        if started is not None:
            return await _fail_started(request, started, exc, APIError.internal())
        log.exception("request %s: %s %s failed", request[REQUEST_ID], request.method,
                      request.path)
        return _respond(request, APIError.internal())


def _started(request: web.BaseRequest) -> Optional[web.StreamResponse]:
    resp = request.get(_PREPARED)
    return resp if resp is not None and resp.prepared else None


async def _fail_started(request, response: web.StreamResponse, exc: BaseException,
                        err: APIError) -> web.StreamResponse:
    """The status line already went out. An SSE stream can still end with an error event
    (what OpenAI does; the SDK raises it as APIError). Any other body cannot be amended:
    re-raise so aiohttp drops the connection rather than end a truncated body cleanly."""
    if isinstance(exc, ConnectionError):  # the client left: nothing failed, no one to tell
        log.info("request %s: %s %s: the client went away mid-response", request[REQUEST_ID],
                 request.method, request.path)
        return response
    if isinstance(exc, APIError):
        log.warning("request %s: stream ended with %s %s", request[REQUEST_ID],
                    err.status, err.message)
    else:
        log.error("request %s: %s %s failed mid-response", request[REQUEST_ID],
                  request.method, request.path, exc_info=exc)
    writer = request.writer
    if response.content_type != "text/event-stream" or (writer is not None
                                                         and writer.output_size == 0):
        # Not a stream, or its prepare failed while writing the headers (nothing went
        # out, yet the connection's writer is set up for that response): no answer can
        # be written cleanly any more. Dropping the connection is the honest end.
        raise exc
    envelope = _envelope_of(request)
    try:
        await response.write(error_event(err) if envelope is None
                             else envelope.event(err, get_request_id(request)))
        await response.write_eof()
    except Exception:  # the client is gone; nothing left to tell it
        pass
    return response


def _from_http_exception(request: web.BaseRequest, exc: web.HTTPException) -> APIError:
    if isinstance(exc, web.HTTPNotFound):
        return APIError.not_found(request.path, request.method)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return APIError.method_not_allowed(exc.method, request.path, exc.allowed_methods)
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return APIError.payload_too_large(request.client_max_size)
    # Anything else aiohttp (or a handler) raised: keep its status, text and extra headers.
    headers = {k: v for k, v in exc.headers.items()
               if k.lower() not in ("content-type", "content-length")}
    return APIError(exc.status, exc.text or exc.reason,
                    INVALID_REQUEST if exc.status < 500 else SERVER_ERROR,
                    None, None, headers)


def install_request_id(app: web.Application) -> None:
    """Add the X-Request-ID header to every response the app prepares. Pair it with
    `error_middleware` in the app's middlewares (first, so it wraps the others)."""
    app.on_response_prepare.append(_on_response_prepare)


def install(app: web.Application) -> None:
    """Both at once: error_middleware first in the chain, and the request-id signal."""
    app.middlewares.insert(0, error_middleware)
    install_request_id(app)


# ---- request bodies ------------------------------------------------------------------

_PARSE_MESSAGE = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The OpenAI API expects a JSON payload, but what was "
    "sent was not valid JSON.)"
)


def _reject_constant(name: str):
    raise ValueError(name)  # NaN/Infinity are not JSON, whatever Python's json allows


# Seconds a request body may take to arrive (--body-timeout; none if the app sets none).
BODY_TIMEOUT = web.AppKey("mlxd_body_timeout", float)


# Bodies up to this size are parsed on the event loop: a few milliseconds at most.
INLINE_PARSE_BYTES = 256 << 10


async def read_json(request: web.BaseRequest) -> dict:
    """The body as a JSON object (its Content-Type is the guard's business: http/guard.py).
    A body over the app's client_max_size is a 413, one slower than BODY_TIMEOUT a 408,
    anything not a JSON object a 400, and so is a value no layer below can carry
    (http/values.py), named by its path."""
    timeout = request.app.get(BODY_TIMEOUT) if request.app is not None else None
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:
        raise APIError.payload_too_large(request.client_max_size) from None
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s.",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return await parse_json(raw)


async def parse_json(raw: bytes | str) -> dict:
    """A request body (or a WebSocket message) as a JSON object, or the 400 read_json
    gives."""
    if len(raw) > INLINE_PARSE_BYTES:
        # Parsing and checking a body of megabytes takes seconds of Python: on a thread,
        # the event loop keeps serving everyone else meanwhile.
        return await asyncio.to_thread(_parse_body, raw)
    return _parse_body(raw)


def _parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)  # bytes: UTF-8/16/32
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError.bad_request(_PARSE_MESSAGE) from None
    if not isinstance(body, dict):
        raise APIError.bad_request(
            "The request body must be a JSON object, got "
            f"{_json_type(body)} instead.")
    bad = first_bad_value(body)
    if bad is not None:
        param, why = bad
        raise APIError.bad_request(f"Invalid value for '{param}': {why}", param, "invalid_value")
    return body


def _json_type(value) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"
