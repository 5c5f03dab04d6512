"""Model swaps: how long they take against a cold load, and whether they leak memory.

    python -m bench.swap [--preset small|tiny] [--swaps 10] [--loads 3]

Builds two different models of the preset (random weights, float32; seeds 1 and 2), starts
mlxd on the first, then:
- cold load: `POST /admin/load` of the second model into a fresh worker, then unload it
  (repeated --loads times; the table shows the median);
- swaps: --swaps alternating `POST /admin/swap` (drain) between the two, each timed as
  the admin client sees it (the new worker loads, then the old one is drained and stopped).
Prints swap time ÷ cold load time (goal ≤ 1.2) and the RSS of the supervisor plus its
workers after the last swap ÷ after the first load (goal ≤ 1.05: no leak).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

import psutil

from bench.make_model import MODELS_DIR
from bench.report import goal, print_table
from bench.serverproc import ServerProcess

SWAP_GOAL, RSS_GOAL = 1.2, 1.05


def build(preset: str, seed: int) -> str:
    from worker.demos.text import build_model
    return str(build_model(MODELS_DIR / f"{preset}-seed{seed}", preset, seed=seed).path)


class Admin:
    def __init__(self, srv: ServerProcess):
        self.url = srv.url
        self.token = (srv.state_dir / "admin-token").read_text().strip()

    def post(self, path: str, body: dict) -> tuple[dict, float]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.load(r)
        return out, time.perf_counter() - t0


def chat(srv: ServerProcess, model: str) -> None:
    req = urllib.request.Request(srv.url + "/v1/chat/completions", method="POST", data=json.dumps({
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def settled_rss(srv: ServerProcess, workers: int, timeout: float = 30.0) -> int:
    """Supervisor + worker RSS once exactly `workers` worker processes remain (the
    retired ones reaped)."""
    sup = psutil.Process(srv.proc.pid)
    deadline = time.monotonic() + timeout
    while True:
        kids = [k for k in sup.children(recursive=True) if k.status() != psutil.STATUS_ZOMBIE]
        _, health = srv.get("/health")
        if len(kids) == workers and len(health["workers"]) == workers:
            return sup.memory_info().rss + sum(k.memory_info().rss for k in kids)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(kids)} worker processes, expected {workers}")
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.swap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--loads", type=int, default=3)
    args = p.parse_args()
    a, b = build(args.preset, 1), build(args.preset, 2)

    srv = ServerProcess([a], "--keep-alive", "0")
    try:
        srv.wait_healthy()
        admin = Admin(srv)
        chat(srv, a)
        rss_first = settled_rss(srv, 1)
        loads = []
        for _ in range(args.loads):
            _, seconds = admin.post("/admin/load", {"model": b})
            loads.append(seconds)
            chat(srv, b)
            admin.post("/admin/unload", {"model": b})
        settled_rss(srv, 1)
        swaps = []
        current = a
        for _ in range(args.swaps):
            target = b if current == a else a
            out, seconds = admin.post("/admin/swap", {"model": target, "mode": "drain"})
            assert out["replaced"] == [current], out
            swaps.append(seconds)
            chat(srv, target)
            current = target
        rss_last = settled_rss(srv, 1)
    finally:
        srv.stop()

    load = statistics.median(loads)
    swap = statistics.median(swaps)
    ratio, growth = swap / load, rss_last / rss_first
    rows = [
        ("models", f"{args.preset} seed 1 / seed 2 ({Path(a).parent})", ""),
        ("cold load s (median of %d)" % len(loads), f"{load:.3f} (first {loads[0]:.3f})", ""),
        ("swap s (median of %d)" % len(swaps),
         f"{swap:.3f} (min {min(swaps):.3f}, max {max(swaps):.3f})", ""),
        ("swap / cold load", f"{ratio:.3f}", goal(ratio, "<=", SWAP_GOAL)),
        ("RSS after first load", f"{rss_first / 2**20:.1f} MiB", ""),
        (f"RSS after swap {len(swaps)}", f"{rss_last / 2**20:.1f} MiB", ""),
        ("RSS growth", f"{growth:.3f}", goal(growth, "<=", RSS_GOAL)),
    ]
    print_table(f"python -m bench.swap --preset {args.preset} --swaps {args.swaps}", rows)


if __name__ == "__main__":
    main()
