"""Soak: many clients, mixed requests, a worker killed and frozen under them, then the
supervisor restarted. Bounded in count and time; loopback only.

    python -m bench.soak [--clients 64] [--requests 2000] [--kills 3] [--stops 1] [--preset tiny]

64 concurrent clients send 2000 requests, drawn at random (seeded) from: chat completions
streamed and not, legacy completions, Responses with `store` streamed and not, streams the
client cancels after two events, and bad inputs. During the run the model's worker is
SIGKILLed `--kills` times and SIGSTOPped `--stops` times (the supervisor must see the hang
by its heartbeats and replace it); after it the supervisor is stopped (SIGTERM) and started
again on the same state directory, and every response that was stored is fetched back.

Printed (issue "Reliability and security"): requests served, refused with 503 +
Retry-After, failed with a retryable error, hung (goal 0), other 5xx (goal 0), stored
responses lost (goal 0), supervisor RSS growth over the run (goal < 5%), event-loop lag p99
from the server's own histogram (goal < 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.make_model import model_path
from bench.report import goal, print_table
from bench.serverproc import ServerProcess

TIMEOUT_S = 60.0    # a request that takes longer counts as hung
KINDS = (("chat", 25), ("chat_stream", 20), ("completion", 10), ("response", 15),
         ("response_stream", 10), ("cancel", 10), ("bad", 10))
RETRYABLE = {"worker_failed", "server_error", "overloaded"}


class Tally:
    def __init__(self):
        self.counts = collections.Counter()
        self.stored: list[str] = []
        self.examples: dict[str, str] = {}

    def add(self, outcome: str, detail: str = "") -> None:
        self.counts[outcome] += 1
        if detail and outcome not in self.examples:
            self.examples[outcome] = detail[:300]


def body_for(kind: str, model: str, rng: random.Random,
             words_in: tuple[int, int] = (3, 40)) -> tuple[str, dict | bytes]:
    """A request of `kind` (KINDS, or "messages": Anthropic's) whose prompt is a number of
    words drawn from `words_in`."""
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "mlx", "metal", "cache"))
                     for _ in range(rng.randint(*words_in)))
    chat = {"model": model, "messages": [{"role": "user", "content": words}],
            "max_tokens": rng.randint(2, 12), "temperature": 0.7}
    if kind == "chat":
        return "/v1/chat/completions", chat
    if kind in ("chat_stream", "cancel"):
        return "/v1/chat/completions", {**chat, "max_tokens": 24 if kind == "cancel"
                                        else chat["max_tokens"], "stream": True}
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": words, "max_tokens": 6}
    if kind == "messages":
        return "/v1/messages", {"model": model, "max_tokens": chat["max_tokens"],
                                "messages": chat["messages"]}
    if kind in ("response", "response_stream"):
        return "/v1/responses", {"model": model, "input": words, "store": True,
                                 "max_output_tokens": rng.randint(2, 12),
                                 "stream": kind == "response_stream"}
    bad = rng.choice([b"{not json", json.dumps({**chat, "temperature": "hot"}).encode(),
                      json.dumps({**chat, "max_tokens": -1}).encode(),
                      json.dumps({"model": model, "messages": "hi"}).encode()])
    return "/v1/chat/completions", bad


async def one(client: httpx.AsyncClient, kind: str, model: str, rng: random.Random,
              tally: Tally, words_in: tuple[int, int] = (3, 40),
              timeout: float = TIMEOUT_S) -> None:
    path, body = body_for(kind, model, rng, words_in)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = isinstance(body, dict) and body.get("stream")
    async def send():
        if stream:
            await _streamed(client, path, content, kind, tally)
        else:
            r = await client.post(path, content=content)
            _judge(r.status_code, r.headers, r.content, kind, tally)

    try:
        await asyncio.wait_for(send(), timeout)
    except asyncio.TimeoutError:
        tally.add("hung", f"{kind} {path}")
    except httpx.TransportError as e:
        # The server closed a connection mid-answer: a client retries on a new one.
        tally.add("retryable", f"{kind}: {type(e).__name__}")


async def _streamed(client, path, content, kind, tally) -> None:
    async with client.stream("POST", path, content=content) as r:
        if r.status_code != 200:
            _judge(r.status_code, r.headers, await r.aread(), kind, tally)
            return
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            data = line[6:]
            if kind == "cancel" and events >= 2:
                tally.add("served")
                return  # leaving closes the stream: the server must cancel it
            if data == "[DONE]":
                tally.add("served")
                return
            event = json.loads(data)
            if "error" in event and event.get("type") != "response.failed":
                code = (event["error"] or {}).get("code") or (event["error"] or {}).get("type")
                tally.add("retryable" if code in RETRYABLE else "5xx_other", f"stream {code}")
                return
            if event.get("type") in ("response.completed", "response.incomplete"):
                tally.stored.append(event["response"]["id"])
                tally.add("served")
                return
            if event.get("type") in ("response.failed", "error"):
                tally.add("retryable", f"stream {event.get('type')}")
                return
        tally.add("served" if kind == "cancel" else "5xx_other", f"{kind}: stream cut short")


def _judge(status: int, headers, raw: bytes, kind: str, tally: Tally) -> None:
    if kind == "bad":
        tally.add("bad_input_4xx" if 400 <= status < 500 else "5xx_other",
                  f"bad input -> {status}")
        return
    if status == 200:
        if kind == "response":
            body = json.loads(raw)
            if body.get("status") in ("completed", "incomplete"):
                tally.stored.append(body["id"])
        tally.add("served")
    elif status == 503 and "Retry-After" in headers:
        code = _code(raw)
        tally.add("refused_503" if code != "worker_failed" else "retryable", f"503 {code}")
    elif status in (502, 503) or _code(raw) == "worker_failed":
        tally.add("retryable", f"{status} {_code(raw)}")
    elif status >= 500:
        tally.add("5xx_other", f"{status} {raw[:200]!r}")
    else:
        tally.add("4xx_unexpected", f"{kind} -> {status} {raw[:200]!r}")


def _code(raw: bytes) -> str | None:
    try:
        return json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def lag_p99(metrics_text: str) -> float | None:
    """The 99th percentile of mlxd_event_loop_lag_seconds, from its histogram buckets
    (the upper bound of the bucket it falls in)."""
    buckets = []
    for line in metrics_text.splitlines():
        if line.startswith("mlxd_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le),
                            float(line.split()[-1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= 0.99 * total)


async def chaos(srv: ServerProcess, done: collections.Counter, total: int, kills: int,
                stops: int, stop_for: float) -> list[str]:
    """Kill the worker at spread points of the run, then freeze it once."""
    plan = [("kill", (i + 1) / (kills + stops + 1)) for i in range(kills)]
    plan += [("stop", (kills + i + 1) / (kills + stops + 1)) for i in range(stops)]
    log = []
    for action, at in plan:
        while sum(done.values()) < at * total:
            await asyncio.sleep(0.1)
        pids = await asyncio.to_thread(_worker_pids, srv)
        if not pids:
            log.append(f"{action}: no worker at {at:.0%}")
            continue
        pid = pids[0]
        log.append(f"{action} pid {pid} at {sum(done.values())} requests")
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)  # the supervisor must see the hang and replace it
            await asyncio.sleep(stop_for)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return log


def _worker_pids(srv: ServerProcess) -> list[int]:
    for _ in range(100):
        try:
            pids = srv.worker_pids()
        except Exception:
            pids = []
        if pids:
            return pids
        time.sleep(0.1)
    return []


async def run_load(srv: ServerProcess, model: str, clients: int, requests: int, seed: int,
                   kills: int, stops: int, stop_for: float, rss: dict) -> tuple[Tally, list]:
    rng = random.Random(seed)
    kinds = [k for k, w in KINDS for _ in range(w)]
    work = asyncio.Queue()
    for _ in range(requests):
        work.put_nowait(rng.choice(kinds))
    tally = Tally()
    proc = psutil.Process(srv.proc.pid)

    async def client_loop(n: int):
        local = random.Random(seed + n)
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT_S, limits=limits,
                                     headers={"Content-Type": "application/json"}) as c:
            while not work.empty():
                kind = work.get_nowait()
                await one(c, kind, model, local, tally)
                finished = sum(tally.counts.values())
                if "warm" not in rss and finished >= requests // 10:
                    rss["warm"] = proc.memory_info().rss

    chaos_task = asyncio.create_task(chaos(srv, tally.counts, requests, kills, stops, stop_for))
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    rss["end"] = proc.memory_info().rss
    try:  # the faults all happen within the run; one still under way finishes
        chaos_log = await asyncio.wait_for(chaos_task, 60)
    except asyncio.TimeoutError:
        chaos_log = ["(some planned faults never happened: the run ended first)"]
    return tally, chaos_log


def stored_lost(model_dir: str, state: Path, ids: list[str], extra: list[str]) -> int:
    with ServerProcess([model_dir], *extra, state_dir=state) as again:
        again.wait_healthy()
        lost = 0
        with httpx.Client(base_url=again.url, timeout=30) as c:
            for rid in ids:
                if c.get(f"/v1/responses/{rid}").status_code != 200:
                    lost += 1
        return lost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--stops", type=int, default=1)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    model = str(model_path(args.preset, None))
    heartbeat = 3.0
    extra = ["--max-queue", "512", "--heartbeat-timeout", str(heartbeat),
             "--restart-backoff", "0.2", "--crash-budget", "20", "--queue-timeout", "45"]
    rss: dict = {}
    with tempfile.TemporaryDirectory(prefix="mlxd-soak-") as tmp:
        state = Path(tmp) / "state"
        state.mkdir(mode=0o700)
        t0 = time.monotonic()
        srv = ServerProcess([model], *extra, state_dir=state)
        try:
            srv.wait_healthy()
            tally, chaos_log = asyncio.run(run_load(
                srv, model, args.clients, args.requests, args.seed, args.kills, args.stops,
                heartbeat + 2, rss))
            elapsed = time.monotonic() - t0
            p99 = lag_p99(httpx.get(srv.url + "/metrics", timeout=10).text)
        finally:
            srv.stop()
        lost = stored_lost(model, state, tally.stored, extra)
    c = tally.counts
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss.get("warm") else float("nan")
    rows = [
        ("requests", f"{sum(c.values())} in {elapsed:.0f} s ({args.clients} clients)", ""),
        ("served (2xx)", str(c["served"]), ""),
        ("bad inputs answered 4xx", str(c["bad_input_4xx"]), ""),
        ("refused 503 + Retry-After", str(c["refused_503"]), ""),
        ("failed, retryable error", str(c["retryable"]), ""),
        ("hung", str(c["hung"]), goal(c["hung"], "<=", 0)),
        ("5xx other than those", str(c["5xx_other"]), goal(c["5xx_other"], "<=", 0)),
        ("unexpected 4xx", str(c["4xx_unexpected"]), ""),
        ("stored responses lost", f"{lost} of {len(tally.stored)}", goal(lost, "<=", 0)),
        ("supervisor RSS growth", f"{growth:+.1%} ({rss.get('warm', 0) >> 20} -> "
                                  f"{rss.get('end', 0) >> 20} MiB)", goal(growth, "<=", 0.05)),
        ("event-loop lag p99", f"{p99 * 1000:.1f} ms" if p99 is not None else "n/a",
         goal(p99 if p99 is not None else 1, "<=", 0.05)),
    ]
    print_table(f"soak: {args.requests} requests, worker killed {args.kills}x and stopped "
                f"{args.stops}x, supervisor restarted", rows)
    print("  chaos: " + "; ".join(chaos_log))
    for outcome, example in sorted(tally.examples.items()):
        print(f"  e.g. {outcome}: {example}")


if __name__ == "__main__":
    main()
