"""Where a request's time to first token goes (a short prompt, a cold 2000-token prompt,
and a warm prefix): raw mlx-lm, mlxd's batch in-process (no HTTP, no worker process), and
the server, on one model in one run.

    python -m bench.ttft_probe [--shape tiny|0.5b|7b] [--rounds 5]

Each figure is a median of rounds (the first dropped: compiles). The in-process batch is
worker/loop/batch.py driven as the scheduler drives it, with the per-step times of the 2000-token
requests printed: admission (prefix lookup and insert), then each step until its first
token. What the server adds over the in-process batch is the HTTP, IPC and scheduling
path; what the batch adds over raw is mlx-lm's BatchGenerator and mlxd's batch.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

from bench.gpu import (Raw, Seq, build, default_dtype, greedy, in_process, server_stream,
                       time_methods)
from bench.serverproc import ServerProcess


TIMED: list[str] = []


def _time_methods() -> None:
    """Time the batch's methods (and mx.eval): each call's ms goes to TIMED."""
    import importlib

    import mlx.core as mx
    g = importlib.import_module("mlx_lm.generate")
    time_methods([(g.PromptProcessingBatch, ("split", "generate", "prompt", "_copy")),
                  (g.GenerationBatch, ("__init__", "_step", "next")),
                  (g.BatchGenerator, ("_next",)),
                  (mx, ("eval", "async_eval", "clear_cache"))],
                 lambda label, s: TIMED.append(f"{label} {1000 * s:.2f} ms"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default=None)
    p.add_argument("--timers", action="store_true", help="time mlx-lm's batch methods")
    p.add_argument("--server-args", default="--max-batch-size 32;--kv-budget 24G "
                   "--max-batch-size 32 --prefill-batch-size 8",
                   help="mlxd flags, one server per ';'-separated set")
    a = p.parse_args()
    import mlx.core as mx

    dtype = default_dtype(a.dtype)
    path = build(a.shape, dtype)
    rng = random.Random(0)
    vocab = 4000
    prompt = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731

    from mlx_lm.models.cache import make_prompt_cache
    raw = Raw(path)
    r_cold, r_pre, r_warm = [], [], []
    for _ in range(a.rounds + 1):
        long, suffix = prompt(2000), prompt(16)
        r_cold.append(raw.stream(prompt(32), 2)[0])
        r_pre.append(raw.stream(prompt(2000), 2)[0])
        cache = make_prompt_cache(raw.model)
        raw.model(mx.array(long)[None], cache=cache)
        mx.eval([c.state for c in cache])
        r_warm.append(raw.stream(suffix, 2, cache=copy.deepcopy(cache))[0])

    eng, batch = in_process(path, max_size=8)

    def run(ids, rid, trace=None):
        prep = greedy(eng, rid, ids, 2)
        t0 = time.perf_counter()
        batch.add(Seq(rid), prep)
        marks = [("add", time.perf_counter() - t0)]
        first = None
        while batch.members:
            outs = batch.step()
            marks.append(("step", time.perf_counter() - t0))
            for _, out in outs:
                if first is None:
                    first = time.perf_counter() - t0
        if trace is not None:
            trace.append(marks)
        return first

    if a.timers:
        _time_methods()
    b_cold, b_pre, b_warm, traces, pre_traces = [], [], [], [], []
    for _ in range(a.rounds + 1):
        long, suffix = prompt(2000), prompt(16)
        b_cold.append(run(prompt(32), "c"))
        b_pre.append(run(long, "l", pre_traces))
        b_warm.append(run(long + suffix, "w", traces))

    servers = {}
    for flags in a.server_args.split(";"):
        s_cold, s_pre, s_warm = [], [], []
        with ServerProcess([str(path)], *flags.split()) as srv:
            srv.wait_healthy(timeout=900)
            for _ in range(a.rounds + 1):
                long, suffix = prompt(2000), prompt(16)
                s_cold.append(server_stream(srv.port, str(path), prompt(32), 2)[0])
                s_pre.append(server_stream(srv.port, str(path), long, 2)[0])
                s_warm.append(server_stream(srv.port, str(path), long + suffix, 2)[0])
        servers[flags] = (s_cold, s_pre, s_warm)

    med = lambda xs: statistics.median(xs[1:]) * 1000  # noqa: E731
    print(f"{a.shape} {dtype} on {mx.default_device()}: TTFT ms (median of {a.rounds})")
    print(f"  32-token prompt: raw {med(r_cold):.1f}  batch {med(b_cold):.1f}")
    print(f"  cold 2000:       raw {med(r_pre):.1f}  batch {med(b_pre):.1f}")
    print(f"  warm 2000+16:    raw {med(r_warm):.1f}  batch {med(b_warm):.1f}")
    for flags, (s_cold, s_pre, s_warm) in servers.items():
        print(f"  server [{flags}]: 32-token {med(s_cold):.1f}, cold 2000 {med(s_pre):.1f}, "
              f"warm {med(s_warm):.1f}")
    for name, kept in (("cold", pre_traces), ("warm", traces)):
        for marks in kept[1:3]:
            print(f"  batch {name} trace (ms since add):",
                  ", ".join(f"{k} {v * 1000:.1f}" for k, v in marks))
    for line in TIMED[-40:]:
        print("   ", line)


if __name__ == "__main__":
    main()
