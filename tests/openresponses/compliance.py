"""The Open Responses compliance cases, ported to Python: what a client that nobody here
wrote sends to `/v1/responses` (HTTP, SSE and WebSocket) and to `/v1/responses/compact`,
and what it checks in the answers.

The upstream suite (openresponses/openresponses, src/lib/compliance-tests.ts, run with
bun) is TypeScript; this workplace may not commit code taken from another repository,
so each of its 17 cases is re-written here from what the case sends and checks (SOURCE.md
beside this file names the version followed). Same ids, same requests, same checks.
Upstream validates with zod schemas generated from the Open Responses specification;
here responses and events (SSE and WebSocket alike) are validated against the Open
Responses schema of tests/openresponses/schema/ (`ResponseResource`, `StreamingEvent`),
and the two shapes it does not hold against OpenAI's (tests/schema.py: `CompactResource`,
and `ResponsesClientEventResponseCreate` for each request sent over the socket).

    suite = Suite(base_url, model)
    errors = cases.CASES["basic-response"](suite)      # [] when the case passes

Cases run one at a time (upstream starts them all at once); each WebSocket turn waits 30 s
at most for its terminal event, as upstream does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
from jsonschema.exceptions import best_match

from tests import schema as openai_schema
from tests.integration.conftest import sse_events
from tests.openresponses import schema as open_responses

OPEN_RESPONSES_SHAPES = ("ResponseResource", "StreamingEvent")

TURN_TIMEOUT_S = 30.0
TERMINAL = ("response.completed", "response.failed", "response.incomplete")
WEATHER_TOOL = {
    "type": "function", "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {"type": "object", "properties": {"location": {
        "type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
        "required": ["location"]}}
# A 32×32 PNG (a red heart on white), as upstream sends it inline.
HEART_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAIAAAD8GO2jAAABmklEQVR42tyWAa"
    "TyUBzFew/eG4AHz+MBSAHKBiJRGFKwIgQQJKLUIioBIhCAiCAAEizAQIAECaASqFFJq84nudjnaqvuPnxzgP9x"
    "frq5938csPn7PwHTKSoViCIEAYEAMhmoKsU2mUCWEQqB5xEMIp/HaGQG2G6RSuH9HQ7H34rFrtPbdz4jl6Pbwm"
    "Esl3QA1mt4vcRKk8dz9eg6IpF7tt9fzGY0gCgafFRFo5Blc5vLhf3eCOj1yNhM5GRMVK0aATxPZoz09YXjkQDm"
    "czJgquGQAPp9WwCNBgG027YACgUC6HRsAZRKBDAY2AJoNv/ZnwzA6WScznG3p4UAymXGAEkyXrTFAh8fLAGqag"
    "QAyGaZpYsi7bHTNPz8MEj//LxuFPo+UBS8vb0KaLXubrRa7aX0RMLCykwmn0z3+XA4WACcTpCkh9MFAZpmuVXo"
    "+mO/w+/HZvNgbblcUCxaSo/Hyck80Yu6XXDcvfVZr79cvMZjuN2U9O9vKAqjZrfbIZ0mV4TUi9Xqz6jddNy//7"
    "+e3n8Fhf/Llo2kxi8AQyGRoDkmAhAAAAAASUVORK5CYII=")


def schema_problems(instance, name: str, prefix: str = "") -> list[str]:
    """One line per schema error, naming the deepest cause under a oneOf/anyOf. Open
    Responses' own shapes (ResponseResource, StreamingEvent) are checked against its
    schema (tests/openresponses/schema/), as upstream does; the two it has not
    (CompactResource, the WebSocket response.create event) against OpenAI's."""
    if name in OPEN_RESPONSES_SHAPES:
        found = open_responses.validator(name).iter_errors(instance)
    else:
        found = openai_schema.errors(instance, name)
    out = []
    for error in found:
        error = best_match(error.context) if error.context else error
        where = ".".join(map(str, error.absolute_path)) or "(root)"
        out.append(f"{prefix}{where}: {error.message[:300]}")
    return out


def message(role: str, content, **extra) -> dict:
    return {"type": "message", "role": role, "content": content, **extra}


@dataclass
class Turn:
    """One response's events, over SSE or one WebSocket turn."""
    events: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    final: dict | None = None  # the response a terminal event carried
    error_event: dict | None = None

    @property
    def error_code(self) -> str | None:
        for source in (self.error_event, self.final):
            error = (source or {}).get("error")
            if isinstance(error, dict) and isinstance(error.get("code"), str):
                return error["code"]
        return None

    @property
    def failed(self) -> bool:
        return bool(self.error_event) or (self.final or {}).get("status") == "failed"

    def take(self, event) -> bool:
        """Record one event; True when it ends the turn."""
        self.events.append(event)
        self.errors += schema_problems(event, "StreamingEvent", f"event {event.get('type')}: ")
        if event.get("type") in TERMINAL and isinstance(event.get("response"), dict):
            self.final = event["response"]
            return True
        if event.get("type") == "error" or isinstance(event.get("error"), dict):
            self.error_event = event
            return True
        return False


class Suite:
    """The client side: the base URL (ending in /v1), the model and an API key."""

    def __init__(self, base_url: str, model: str, api_key: str = "openresponses"):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"}

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.base_url + path, json=body, headers=self.headers, timeout=120)

    def stream(self, body: dict) -> Turn:
        turn = Turn()
        with httpx.stream("POST", self.base_url + "/responses", json={**body, "stream": True},
                          headers=self.headers, timeout=120) as r:
            if r.status_code != 200:
                turn.errors.append(f"HTTP {r.status_code}: {r.read().decode()[:500]}")
                return turn
            for event in sse_events(r):
                if event != "[DONE]":
                    turn.take(event)
        return turn

    def socket(self, *steps) -> list[Turn]:
        """One WebSocket connection, one turn per step: a request, or a function of the
        turns so far that returns one (None ends the connection early)."""
        return asyncio.run(self._socket(steps))

    async def _socket(self, steps) -> list[Turn]:
        url = "ws" + self.base_url.removeprefix("http") + "/responses"
        turns: list[Turn] = []
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(url, headers=self.headers) as ws:
            for step in steps:
                body = step(turns) if callable(step) else step
                if body is None:
                    break
                turn = Turn(errors=schema_problems(body, "ResponsesClientEventResponseCreate",
                                           "request: "))
                turns.append(turn)
                await ws.send_str(json.dumps(body))
                await self._read_turn(ws, turn)
        return turns

    @staticmethod
    async def _read_turn(ws, turn: Turn) -> None:
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while True:
            try:
                msg = await ws.receive(timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                turn.errors.append("timed out waiting for a terminal WebSocket event")
                return
            if msg.type != aiohttp.WSMsgType.TEXT:
                turn.errors.append(f"WebSocket closed before a terminal event ({msg.type.name})")
                return
            if msg.data == "[DONE]":
                turn.errors.append("[DONE] before a terminal WebSocket event")
                return
            try:
                event = json.loads(msg.data)
            except ValueError:
                turn.errors.append(f"not JSON: {msg.data[:200]}")
                continue
            if turn.take(event):
                return

    def create(self, text_or_items, **fields) -> dict:
        return {"type": "response.create", "model": self.model, "input": text_or_items,
                **fields}


# --- the checks upstream's validators make ------------------------------------------

def response_errors(response, *, output=True, completed=True) -> list[str]:
    if not isinstance(response, dict):
        return ["no response object"]
    errors = schema_problems(response, "ResponseResource")
    if output and not response.get("output"):
        errors.append("response has no output items")
    if completed and response.get("status") != "completed":
        errors.append(f"expected status completed, got {response.get('status')!r}")
    return errors


def turn_errors(turn: Turn, prefix: str = "") -> list[str]:
    errors = list(turn.errors) + ([] if turn.events else ["no streaming events"])
    errors += response_errors(turn.final, output=False)
    return [prefix + e for e in errors]


def http_case(suite: Suite, input_items, *, tools=None, expect_type=None) -> list[str]:
    body = {"model": suite.model, "input": input_items, **({"tools": tools} if tools else {})}
    r = suite.post("/responses", body)
    if r.status_code != 200:
        return [f"HTTP {r.status_code}: {r.text[:500]}"]
    response = r.json()
    errors = response_errors(response, completed=expect_type is None)
    if expect_type and not any(o.get("type") == expect_type for o in response.get("output", ())):
        errors.append(f"no output item of type {expect_type!r}")
    return errors
