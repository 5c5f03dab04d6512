"""Load: 64 clients on every generation route of one real mlxd, in bursts with idle gaps.

Why: the bugs outside testers found under load (issue 30) were each invisible to a test
that sends one request at a time: a healthy worker killed as "hung" because the liveness
clock was not reset when an idle worker got work (it needs an idle gap longer than
--hang-timeout, then a burst), a 500 instead of the 503 when a Responses request waited
past --queue-timeout (it needs a queue), and background responses left `queued` forever
by that same failure. So the server runs with a short queue timeout and a small hang
timeout, and two bursts of mixed traffic, each after an idle gap longer than the hang
timeout, drive chat completions, completions, Responses (whole, streamed, background and
polled, cancelled), Anthropic Messages, embeddings and tokenize; some streams are
abandoned mid-way (the client disconnects).

The load runs once (the module's fixture); each test asserts one property of it, so a
failure names which one broke: no 5xx but the documented 503 (overloaded, Retry-After) and
504 (timeout); every error in its surface's envelope; every request answered (no hang);
no worker killed by the server; every background response in a terminal state. The table
(per route: count, statuses, p50/p95 latency) prints with `-s` and with any failure.
Bounded: about a minute on 2 cores; all traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

CLIENTS = 64
BURSTS = 2
PER_CLIENT = 2          # requests each client sends in a burst, one after the other
QUEUE_TIMEOUT = 2.0
HANG_TIMEOUT = 3.0
IDLE_GAP = HANG_TIMEOUT + 1.5  # idle before each burst: the idle->busy race needs it
CLIENT_TIMEOUT = 30.0   # a request unanswered this long has hung
MAX_TOKENS = 48         # long enough that 64 clients queue past QUEUE_TIMEOUT
TERMINAL = {"completed", "failed", "cancelled", "incomplete"}
ANTHROPIC = "/v1/messages"


@dataclass
class Load:
    """What the load saw: per request (row, status, seconds), the problems by kind, and
    the background responses created."""
    model: str
    embed: str
    rows: list = field(default_factory=list)
    problems: dict = field(default_factory=lambda: collections.defaultdict(list))
    background: list = field(default_factory=list)
    final_background: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    log: str = ""

    def problem(self, kind: str, row: str, text: str) -> None:
        self.problems[kind].append(f"{row}: {text[:300]}")

    def table(self) -> str:
        by_row = collections.defaultdict(list)
        for row, status, seconds in self.rows:
            by_row[row].append((status, seconds))
        lines = [f"{'route':36} {'n':>4}  {'p50 s':>6} {'p95 s':>6}  statuses"]
        for row in sorted(by_row):
            seen = by_row[row]
            times = sorted(s for _, s in seen)
            statuses = collections.Counter(str(st) for st, _ in seen)
            lines.append(f"{row:36} {len(seen):4}  {times[len(times) // 2]:6.2f} "
                         f"{times[min(len(times) - 1, int(len(times) * 0.95))]:6.2f}  "
                         + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))
        return "\n".join(lines)

    def report(self, kind: str) -> str:
        return "\n".join(self.problems[kind][:20]) + "\n\n" + self.table()


# ---- checking one answer ----------------------------------------------------------------

def check_error(load: Load, row: str, url: str, r: httpx.Response, body: bytes) -> str:
    """A non-200: only 503 overloaded (with Retry-After) or 504 timeout, in the envelope
    of the route's surface. Returns the status and error code, for the table."""
    try:
        doc = json.loads(body)
    except ValueError:
        load.problem("envelope", row, f"{r.status_code}, not JSON: {body[:200]!r}")
        return f"{r.status_code} not JSON"
    if url.startswith(ANTHROPIC):
        ok = (isinstance(doc, dict) and set(doc) == {"type", "error", "request_id"}
              and doc["type"] == "error" and set(doc["error"]) == {"type", "message"})
        code = doc["error"].get("type") if ok else None
        expected = {503: "overloaded_error", 504: "timeout_error"}
    else:
        ok = (isinstance(doc, dict) and set(doc) == {"error"}
              and set(doc["error"]) == {"message", "type", "param", "code"})
        code = doc["error"].get("code") if ok else None
        expected = {503: "overloaded", 504: "timeout"}
    if not ok:
        load.problem("envelope", row, f"{r.status_code} {body[:200]!r}")
    if (r.status_code not in expected or expected[r.status_code] != code
            or (r.status_code == 503 and not r.headers.get("Retry-After"))):
        load.problem("status", row, f"{r.status_code} (code {code}, Retry-After "
                                    f"{r.headers.get('Retry-After')}): {body[:200]!r}")
    return f"{r.status_code} {code}"


def stream_problem(url: str, events: list) -> str | None:
    """A stream read to its end must end as its surface ends a stream; an error event
    mid-way may only say overloaded or timeout. `events`: (event name, data)."""
    if not events:
        return "no events"
    for name, data in events:
        if data == "[DONE]":
            continue
        err = data.get("error") if isinstance(data, dict) else None
        if name == "error" or (isinstance(data, dict) and data.get("type") == "error") or err:
            kind = (err or {}).get("type") if url.startswith(ANTHROPIC) else (err or data).get(
                "code")
            if kind not in ("overloaded", "timeout", "overloaded_error", "timeout_error"):
                return f"error event {json.dumps(data)[:200]}"
            return None
    name, last = events[-1]
    if url.startswith(ANTHROPIC):
        return None if last.get("type") == "message_stop" else f"ended on {name}"
    if url.startswith("/v1/responses"):
        if last.get("type") not in ("response.completed", "response.incomplete"):
            return f"ended on {json.dumps(last)[:200]}"
        return None
    return None if last == "[DONE]" else f"ended on {json.dumps(last)[:200]}"


async def send(c: httpx.AsyncClient, load: Load, row: str, method: str, url: str,
               body: dict | None = None, *, abandon_after: int | None = None) -> dict | None:
    """One request, checked and timed; its JSON body when it answered 200 with JSON.
    `abandon_after`: a stream is closed (the client disconnects) after that many events."""
    t0 = time.monotonic()
    status: int | str = "hang"
    doc = None
    try:
        async with c.stream(method, url, json=body) as r:
            status = r.status_code
            if r.status_code != 200:
                status = check_error(load, row, url, r, await r.aread())
            elif r.headers.get("content-type", "").startswith("text/event-stream"):
                events, name = [], None
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                        events.append((name, data if data == "[DONE]" else json.loads(data)))
                        name = None
                        if abandon_after is not None and len(events) >= abandon_after:
                            status = "200 abandoned"
                            break
                if abandon_after is None or len(events) < abandon_after:
                    problem = stream_problem(url, events)
                    if problem:
                        load.problem("stream", row, problem)
            else:
                doc = json.loads(await r.aread())
    except httpx.TimeoutException as e:
        load.problem("hang", row, f"no answer within {CLIENT_TIMEOUT:g} s ({type(e).__name__})")
    except httpx.HTTPError as e:
        status = "broken"
        load.problem("hang", row, f"connection broke: {type(e).__name__}: {e}")
    load.rows.append((row, status, time.monotonic() - t0))
    return doc


# ---- the traffic ------------------------------------------------------------------------

def chat(load, stream=False):
    return {"model": load.model, "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": MAX_TOKENS, "stream": stream}


def responses(load, **extra):
    return {"model": load.model, "input": "Tell me a story", "max_output_tokens": MAX_TOKENS,
            **extra}


def messages(load, stream=False):
    return {"model": load.model, "max_tokens": MAX_TOKENS, "stream": stream,
            "messages": [{"role": "user", "content": "Tell me a story"}]}


async def background(c, load, row="responses background+poll", cancel=False):
    doc = await send(c, load, row, "POST", "/v1/responses", responses(load, background=True))
    if doc is None:
        return
    if doc.get("status") != "queued":
        load.problem("status", row, f"a background response began {doc.get('status')}")
    load.background.append(doc["id"])
    if cancel:
        await asyncio.sleep(0.05)
        done = await send(c, load, "responses cancel", "POST", f"/v1/responses/{doc['id']}/cancel")
        if done is not None and done.get("status") not in TERMINAL:
            load.problem("background", "responses cancel", f"cancel answered {done.get('status')}")
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # poll as a client would; the sweep judges the end
        got = await send(c, load, "responses poll", "GET", f"/v1/responses/{doc['id']}")
        if got is None or got.get("status") in TERMINAL:
            return
        await asyncio.sleep(0.25)


SCENARIOS = [
    lambda c, l: send(c, l, "chat", "POST", "/v1/chat/completions", chat(l)),
    lambda c, l: send(c, l, "chat stream", "POST", "/v1/chat/completions", chat(l, True)),
    lambda c, l: send(c, l, "chat stream abandoned", "POST", "/v1/chat/completions",
                      chat(l, True), abandon_after=3),
    lambda c, l: send(c, l, "completions", "POST", "/v1/completions", {
        "model": l.model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS}),
    lambda c, l: send(c, l, "completions stream", "POST", "/v1/completions", {
        "model": l.model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
        "stream": True}),
    lambda c, l: send(c, l, "responses", "POST", "/v1/responses", responses(l)),
    lambda c, l: send(c, l, "responses stream", "POST", "/v1/responses",
                      responses(l, stream=True)),
    lambda c, l: send(c, l, "responses stream abandoned", "POST", "/v1/responses",
                      responses(l, stream=True), abandon_after=4),
    lambda c, l: background(c, l),
    lambda c, l: background(c, l, "responses background+cancel", cancel=True),
    lambda c, l: send(c, l, "messages", "POST", ANTHROPIC, messages(l)),
    lambda c, l: send(c, l, "messages stream", "POST", ANTHROPIC, messages(l, True)),
    lambda c, l: send(c, l, "messages stream abandoned", "POST", ANTHROPIC, messages(l, True),
                      abandon_after=4),
    lambda c, l: send(c, l, "embeddings", "POST", "/v1/embeddings", {
        "model": l.embed, "input": ["a story", "another story"]}),
    lambda c, l: send(c, l, "tokenize", "POST", "/tokenize", {
        "model": l.model, "messages": [{"role": "user", "content": "Tell me a story"}]}),
]


async def client(c: httpx.AsyncClient, load: Load, i: int, burst: int) -> None:
    for j in range(PER_CLIENT):
        await SCENARIOS[(i + burst * 5 + j * 7) % len(SCENARIOS)](c, load)


async def sweep_background(c: httpx.AsyncClient, load: Load, within: float = 30.0) -> None:
    """After the load: every background response must reach a terminal state."""
    pending = set(load.background)
    deadline = time.monotonic() + within
    while pending and time.monotonic() < deadline:
        for rid in list(pending):
            r = await c.get(f"/v1/responses/{rid}")
            status = r.json().get("status") if r.status_code == 200 else f"HTTP {r.status_code}"
            load.final_background[rid] = status
            if status in TERMINAL:
                pending.discard(rid)
        if pending:
            await asyncio.sleep(0.5)


async def drive(srv: ServerProcess, load: Load) -> None:
    limits = httpx.Limits(max_connections=CLIENTS * 2, max_keepalive_connections=CLIENTS)
    timeout = httpx.Timeout(CLIENT_TIMEOUT, connect=5)
    async with httpx.AsyncClient(base_url=srv.url, timeout=timeout, limits=limits) as c:
        for burst in range(BURSTS):
            await asyncio.sleep(IDLE_GAP)
            await asyncio.gather(*(client(c, load, i, burst) for i in range(CLIENTS)))
        await sweep_background(c, load)


@pytest.fixture(scope="module")
def load(tiny_model, embed_model):
    with ServerProcess([str(tiny_model), str(embed_model("bert"))],
                       "--queue-timeout", str(QUEUE_TIMEOUT),
                       "--hang-timeout", str(HANG_TIMEOUT)) as srv:
        srv.wait_healthy()
        result = Load(str(tiny_model), str(embed_model("bert")))
        t0 = time.monotonic()
        asyncio.run(drive(srv, result))
        _, result.health = srv.get("/health")
        result.log = srv.log_path.read_text(errors="replace")
        print(f"\nload: {len(result.rows)} requests from {CLIENTS} clients in {BURSTS} bursts, "
              f"{time.monotonic() - t0:.1f} s\n{result.table()}\nbackground responses at the "
              f"end: {dict(collections.Counter(result.final_background.values()))}")
        yield result


def test_no_5xx_but_overloaded_and_timeout(load):
    assert not load.problems["status"], load.report("status")


def test_every_error_is_the_surfaces_envelope(load):
    assert not load.problems["envelope"], load.report("envelope")


def test_every_request_is_answered_and_every_stream_ends(load):
    assert not load.problems["hang"], load.report("hang")
    assert not load.problems["stream"], load.report("stream")
    assert len(load.rows) >= CLIENTS * PER_CLIENT * BURSTS


def test_no_worker_was_killed_by_the_server(load):
    workers = load.health.get("workers", [])
    assert len(workers) == 2 and all(w["state"] == "ready" for w in workers), workers
    restarts = {w["model"]: (w["restarts"], w["restart_causes"]) for w in workers}
    assert all(n == 0 for n, _ in restarts.values()), f"{restarts}\n\n{load.table()}"
    killed = [line for line in load.log.splitlines()
              if "killed:" in line or "killing worker" in line]
    assert not killed, "\n".join(killed[:10])


def test_every_background_response_ends(load):
    assert load.background, "no background response was accepted"
    stuck = {rid: s for rid, s in load.final_background.items() if s not in TERMINAL}
    assert not stuck and len(load.final_background) == len(load.background), \
        f"{len(stuck)} of {len(load.background)} not terminal: " \
        f"{collections.Counter(stuck.values())}\n\n{load.table()}"


def test_the_server_logged_no_traceback(load):
    """An exception nobody caught shows in the log even where no client saw it (the
    AttributeError that left background responses queued died inside a task), and a
    client that leaves mid-stream (the abandoned streams) is a line, not a traceback."""
    lines = load.log.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Traceback" in line:
            end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith(" ")),
                       len(lines) - 1)
            found.append(lines[i:end + 1])
    assert not found, f"{len(found)} tracebacks; the first:\n" + "\n".join(found[0][-25:])
