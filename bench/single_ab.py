"""One stream's decode, raw mlx-lm against mlxd servers started with different arguments or
environment, rounds alternating, each round one prompt for all: the paired per-round
ratio with its bootstrap 95% interval (bench/report.py) says more than medians on a machine
whose speed drifts between rounds (the H200s here did by ±30% within one run).

    python -m bench.single_ab [--shape 0.5b] [--rounds 40] [--tokens 128] [--prompt 32]
        [--variants '{"default": {}, "no prefix cache": {"args": ["--prompt-cache-bytes", "0"]}}']
        [--mlx-lm-steps] [--cpu] [--budget-s S] [--burst N [--burst-apart S]]

Raw is `stream_generate` in this process; "in-process" is mlxd's batch in this process
(no worker, no HTTP); each variant is a server of its own (`args` to `mlxd`, `env` added
to its environment). `--mlx-lm-steps` adds the in-process batch on mlx-lm's own step
methods instead of worker/loop/lean.py's (what the lean steps save per token).
`--cpu` also prints each side's CPU per token by process and thread (bench/token_cpu.py):
the MLX thread, the process's other threads, and for a server its supervisor and client.
`--burst N`: before each round's stream, untimed, N streams at once on the same side
(raw `batch_generate`, the batch in-process, the server): whether a side that has just
run a wide batch decodes one stream as fast (on a GPU a worker that had run every width
to 32 at load decoded one 12-16% slower ever after: worker/loop/warmup.py).
`--burst-apart S`: the burst's streams sent S seconds apart (in-process: one joining a
step; raw's `batch_generate` takes them at once), so the batch runs widths one after
another, as requests arriving over time make it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench.report import alternate, print_table, ratio_verdict
from bench.decode_probe import run_batch
from bench.gpu import SHAPES, Raw, build, default_dtype, server_many, server_stream
from bench.inprocess import in_process
from bench.serverproc import ServerProcess
from bench.token_cpu import TokenCPU
from supervisor.workers import blas


def mlx_lm_steps(run):
    """`run()` with mlx-lm's own step methods in place of worker/loop/lean.py's."""
    from worker.loop import lean

    lean.ON = False
    try:
        return run()
    finally:
        lean.ON = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32,
                   help="prompt tokens: the context the stream decodes after")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, else float32")
    p.add_argument("--variants", default='{"default": {}}')
    p.add_argument("--mlx-lm-steps", action="store_true")
    p.add_argument("--cpu", action="store_true", help="CPU per token by process and thread")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no round after this many seconds of rounds (a lease's limit): "
                   "the table is of the rounds run")
    p.add_argument("--burst", type=int, default=0, metavar="N",
                   help="N streams at once on a side, untimed, before each of its streams")
    p.add_argument("--burst-apart", type=float, default=0.0, metavar="S",
                   help="the burst's streams S seconds apart (default: all at once)")
    a = p.parse_args()
    dtype = default_dtype(a.dtype)
    path = build(a.shape, dtype)
    raw = Raw(path)
    eng, batch = in_process(path, max_size=32)
    rng = random.Random(0)
    vocab = SHAPES[a.shape]["vocab_size"]

    def prompt():
        return [rng.randrange(3, vocab) for _ in range(a.prompt)]

    servers = {}
    try:
        for name, v in json.loads(a.variants).items():
            t = time.perf_counter()
            s = ServerProcess([str(path)], *v.get("args", []), env=v.get("env", {}))
            servers[name] = s.__enter__()
            s.wait_healthy(600)
            server_stream(s.port, str(path), prompt(), 16)  # compiles
            said = "MLX buffer cache limited"  # (worker/loading/startup.py bound_memory)
            limit = [line[line.index(said):] for line in s.log().splitlines() if said in line]
            print(f"started {name} in {time.perf_counter() - t:.0f} s"
                  + (f"; {limit[-1]}" if limit else ""), flush=True)
        raw.stream(prompt(), 16)
        run_batch(eng, batch, [prompt()], 16, False)
        ids = [prompt() for _ in range(a.rounds)]
        many = [[prompt() for _ in range(a.burst)] for _ in range(a.rounds)]
        sides = {"raw": lambda i: raw.stream(ids[i], a.tokens)[1],
                 "in-process": lambda i: run_batch(eng, batch, [ids[i]], a.tokens, False)}
        if a.mlx_lm_steps:
            sides["in-process, mlx-lm's steps"] = lambda i: mlx_lm_steps(
                lambda: run_batch(eng, batch, [ids[i]], a.tokens, False))
        for name, s in servers.items():
            sides[name] = lambda i, s=s: server_stream(s.port, str(path), ids[i], a.tokens)
        cpu = TokenCPU()
        for name, side in list(sides.items()):
            sides[name] = counted(cpu if a.cpu else None, name, side, servers.get(name),
                                  a.tokens)
        if a.burst:
            apart = a.burst_apart > 0
            bursts = {"raw": lambda i: raw.batch(many[i], a.tokens),
                      "in-process": lambda i: run_batch(eng, batch, many[i], a.tokens, apart)}
            bursts["in-process, mlx-lm's steps"] = lambda i: mlx_lm_steps(
                lambda: run_batch(eng, batch, many[i], a.tokens, apart))
            for name, s in servers.items():
                bursts[name] = lambda i, s=s: server_many(s.port, str(path), many[i], a.tokens,
                                                          a.burst_apart)
            # (after the CPU's count: it counts the stream's tokens only)
            sides = {name: after(bursts[name], side) for name, side in sides.items()}
        until = time.monotonic() + a.budget_s if a.budget_s else None
        got = alternate(a.rounds, sides, label=a.shape, until=until)
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
    done = len(got.clocks)
    print_table(f"{a.shape} {dtype}: one stream of {a.tokens} tokens after {a.prompt}"
                + (f", each after {a.burst} on its side"
                   + (f" {a.burst_apart} s apart" if a.burst_apart else " at once")
                   if a.burst else "") + f", {done} "
                "paired rounds "
                "(decode tok/s median; × raw: geometric mean of the rounds' ratios, 95% interval)",
                [(name, f"{statistics.median(got.figures[name]):.1f} tok/s",
                  ratio_verdict(got.ratio(name, "raw"), ">=", 0.97))
                 for name in got.figures if name != "raw"]
                + ([("in-process / mlx-lm's steps", "lean steps (worker/loop/lean.py)",
                     ratio_verdict(got.ratio("in-process", "in-process, mlx-lm's steps"),
                                   ">=", 1.0))] if a.mlx_lm_steps else []))
    if a.cpu:
        print_table(f"CPU per generated token, us (median of {done} rounds; "
                    "bench/token_cpu.py)", cpu.rows())


def after(burst, side):
    """`side` for `alternate`, `burst(i)` run first (untimed: the side times itself)."""
    return lambda i: (burst(i), side(i))[1]


def counted(cpu, name, side, server, tokens):
    """`side` as `alternate` takes it (round -> decode tok/s), its CPU counted into `cpu`
    (None: not counted); a server's side returns server_stream's (ttft, rate, tokens)."""
    if server is not None:
        if cpu is None:
            return lambda i: side(i)[1]
        return lambda i: cpu.server(name, server, lambda: side(i), lambda r: r[2])[1]
    if cpu is None:
        return side
    return lambda i: cpu.local(name, lambda: side(i), tokens)


if __name__ == "__main__":
    blas.reexec()  # raw multiplies with the BLAS the workers use
    main()
