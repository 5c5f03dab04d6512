"""WebSocket mode of the Responses API: `GET /v1/responses` upgraded to a WebSocket.

Why: an agent that goes back and forth with the model dozens of times (a tool call, its
output, the next turn) keeps one connection open and sends only each turn's new items
with `previous_response_id`, instead of a request per turn. The protocol is OpenAI's and
the Open Responses specification's:

- The client sends text messages, one JSON object each: `{"type": "response.create", ...}`
  with the fields of a `POST /v1/responses` body (`stream` is implied; `background` is
  refused). Responses run one at a time, in the order they were sent (a FIFO per
  connection); each one's events are sent as they come, one text message per event,
  the same objects as the `data:` of the HTTP stream (supervisor/api/responses/runs.py
  records them; nothing here builds events). With `stream_id`, every event of that
  response echoes it.
- Warm-up: `generate: false` prepares a turn without generating: the response is created
  and completes with no output (`response.created`, `response.in_progress`,
  `response.completed`), stored and cached like any other so that a later turn continues
  from it with `previous_response_id`, and its prompt is prefilled on the worker and kept
  under its id (one token is decoded and dropped: the worker has no prefill-only task),
  so the turn that continues it prefills only what is new.
- In-connection cache: the connection keeps its most recent response (the items the
  model read and the output) in memory, so continuing from it needs no store, which is
  how `store: false` chains work here. Any other `previous_response_id` is read from the
  store as over HTTP; a `store: false` response that is not the connection's latest (or
  comes from another connection) is `previous_response_not_found`. A turn that fails
  leaves nothing to continue from: the cache is emptied, so a failed continuation cannot
  be retried on stale state.
- Errors (bad JSON, a binary message, an unknown `type`, a bad field, a missing previous
  response, a model that cannot serve) are an `error` event,
  `{"type": "error", "status": 4xx/5xx, "error": {"type", "code", "message", "param"}}`,
  the status and envelope the same request would get over HTTP; the connection stays
  open. A failure mid-response is the response's own `response.failed`, as over HTTP.
- The same limits as HTTP: keys, Host and Origin are the guard's (http/guard.py) on the
  upgrade; a message may be as large as a body (--max-body-bytes; a larger one closes the
  connection with 1009); the queue and timeouts are the model's, per response.
- A connection that closes cancels its running response (the worker is told, as when an
  HTTP client leaves) and drops those waiting. On shutdown, idle connections are closed
  at once (1001) and busy ones after their response ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import weakref
from typing import Optional

from aiohttp import WSCloseCode, WSMsgType, web

from supervisor.api.fields.params import invalid_value, missing, opt_bool
from supervisor.api.responses.items import output_to_items
from supervisor.api.responses.request import parse_responses_request
from supervisor.api.responses.routes import (RESPONSES, conversation, launch, prepare,
                                             store_unavailable)
from supervisor.api.responses.store import StoreUnavailable
from supervisor.http.errors import APIError, api_error, get_request_id, parse_json
from supervisor.http.sse import PING_INTERVAL_S
from supervisor.keys import CONFIG
from supervisor.workers.errors import WorkerError

log = logging.getLogger("mlxd.responses")

MAX_WAITING = 16  # response.create messages queued behind the running one
CONTINUED = ("completed", "incomplete")  # the ends a later turn may continue from
STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")
SOCKETS = web.AppKey("responses_websockets", weakref.WeakSet)


def setup(app: web.Application) -> None:
    app[SOCKETS] = weakref.WeakSet()
    app.router.add_get("/v1/responses", connect)
    app.on_shutdown.append(_shutdown)


async def connect(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(max_msg_size=request.app[CONFIG].max_body_bytes,
                               heartbeat=PING_INTERVAL_S)
    if not ws.can_prepare(request).ok:
        raise APIError(426, "GET /v1/responses is the Responses API's WebSocket mode: open a "
                            "WebSocket (Upgrade: websocket), or POST /v1/responses.",
                       code="upgrade_required", headers={"Upgrade": "websocket"})
    await ws.prepare(request)
    conn = Connection(request, ws)
    request.app[SOCKETS].add(conn)
    await conn.serve()
    return ws


async def _shutdown(app: web.Application) -> None:
    for conn in list(app[SOCKETS]):
        await conn.close_when_idle()


def _stream_id(body: dict) -> Optional[str]:
    """The lane the response's events echo (OpenAI's pattern: 1-256 of [A-Za-z0-9_.-])."""
    sid = body.get("stream_id")
    if sid is None:
        return None
    if not isinstance(sid, str) or not STREAM_ID.fullmatch(sid):
        raise invalid_value("stream_id", "expected 1 to 256 letters, digits, '_', '.' or '-'.")
    return sid


class Connection:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse):
        self.request = request
        self.ws = ws
        self.svc = request.app[RESPONSES]
        self.waiting: asyncio.Queue = asyncio.Queue()
        self.busy = False
        self.closing = False
        self.last: Optional[tuple[str, list]] = None  # (response id, its conversation)
        self._send_lock = asyncio.Lock()

    async def serve(self) -> None:
        """Read messages until the client closes; the responses run in a task of their
        own, so a close is seen (and cancels them) while one generates."""
        rid = get_request_id(self.request)
        log.debug("websocket %s: open", rid)
        worker = asyncio.create_task(self._work())
        try:
            async for msg in self.ws:
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    continue  # (an ERROR ends the iteration; pings are answered for us)
                if self.waiting.qsize() >= MAX_WAITING:
                    await self._send_error(APIError(
                        429, f"Too many response.create messages waiting on this connection "
                             f"(at most {MAX_WAITING} behind the running one).",
                        code="too_many_waiting"), None)
                    continue
                self.waiting.put_nowait(msg.data)
        finally:
            worker.cancel()  # cancels the running response, drops those waiting
            await asyncio.gather(worker, return_exceptions=True)
            log.debug("websocket %s: closed", rid)

    async def close_when_idle(self) -> None:
        self.closing = True
        if not self.busy and self.waiting.empty():
            await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")

    async def _work(self) -> None:
        while True:
            data = await self.waiting.get()
            self.busy = True
            try:
                await self._one(data)
            finally:
                self.busy = False
            if self.closing and self.waiting.empty():
                await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
                return

    async def _one(self, data) -> None:
        """One client message: a response's events, or one error event. Whatever it is,
        only a response that ends well can be continued from next (the cache's rule)."""
        stream_id, (last, self.last) = None, (self.last, None)
        try:
            if isinstance(data, bytes):
                raise APIError.bad_request("WebSocket mode takes text messages, one JSON "
                                           "object each; this one was binary.")
            body = await parse_json(data)
            stream_id = _stream_id(body)
            kind = body.get("type")
            if kind is None:
                raise missing("type")
            if kind != "response.create":
                raise invalid_value("type", f"'{str(kind)[:64]}' is not a client event of "
                                            "WebSocket mode; send 'response.create'.")
            if self.closing:
                raise APIError(503, "The server is shutting down.", code="shutting_down")
            await self._create(body, stream_id, last)
        except asyncio.CancelledError:
            raise
        except StoreUnavailable as e:
            await self._send_error(store_unavailable(e), stream_id)
        except (APIError, WorkerError) as e:
            await self._send_error(api_error(e), stream_id)
        except ConnectionError:
            pass  # the client is gone: its close ends the connection
        except Exception:  # a bug: this message fails, the connection goes on
            log.exception("websocket %s: response.create failed",
                          get_request_id(self.request))
            await self._send_error(APIError.internal(), stream_id)

    async def _create(self, body: dict, stream_id: Optional[str],
                      last: Optional[tuple[str, list]]) -> None:
        if body.get("background"):
            raise invalid_value("background", "background responses are not supported in "
                                              "WebSocket mode: use POST /v1/responses.")
        generate = opt_bool(body, "generate") is not False
        body = {k: v for k, v in body.items() if k not in ("type", "stream", "stream_id")}
        req = dataclasses.replace(parse_responses_request(body), generate=generate)
        if last is not None and req.previous_response_id == last[0]:
            items = last[1] + list(req.input_items)
        else:
            items = await conversation(self.svc, req)
        run = await prepare(self.request, req, items)
        await launch(self.svc, run)
        try:
            async for event in run.follow():
                await self._send(event, stream_id)
        except BaseException:
            run.cancel()  # the client left (or the send failed): the worker is told
            raise
        if run.builder.status in CONTINUED:
            self.last = (run.id, items + output_to_items(run.builder.output))

    async def _send(self, event: dict, stream_id: Optional[str]) -> None:
        if stream_id is not None:
            event = {**event, "stream_id": stream_id}
        async with self._send_lock:
            await self.ws.send_str(json.dumps(event, separators=(",", ":"),
                                              ensure_ascii=False))

    async def _send_error(self, err: APIError, stream_id: Optional[str]) -> None:
        log.debug("websocket %s: error %s %s", get_request_id(self.request), err.status,
                  err.code)
        error = err.to_envelope()["error"]
        if "Retry-After" in err.headers:
            error["headers"] = {"Retry-After": err.headers["Retry-After"]}
        # The turn's one event: sequence_number 0, as the specifications' error event has one.
        await self._send({"type": "error", "sequence_number": 0, "status": err.status,
                          "error": error}, stream_id)
