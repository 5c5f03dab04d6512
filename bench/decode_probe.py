"""Where concurrent streams' decode time goes: raw mlx-lm `batch_generate`, mlxd's batch
in-process (no HTTP, no worker process), and the server, on one model in one run.

    python -m bench.decode_probe [--shape 0.5b] [--streams 8] [--rounds 3] [--profile]

With `--streams 1` every figure is one stream's decode rate after its first token, raw
being `stream_generate` (mlx-lm's single-sequence path, not its batch).

The in-process batch runs twice: every stream added at once (as raw `batch_generate`
does), and one stream added per step (as a server sees requests that arrive a few
milliseconds apart: later prompts are prefilled while the first decode, and the batch
pads and merges). The gap raw → batch-at-once is mlxd's batch itself (its decoding of
each token: detokenizer, stops, the first-token read); batch-at-once → batch-staggered
is what arrival order costs; batch-staggered → server is HTTP, IPC and the worker's
threads. `--profile` prints where the batch's Python time goes (cProfile, one run).
Figures are aggregate tokens/s, medians of rounds (the first dropped: compiles).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from bench.gpu import Raw, Seq, build, greedy, in_process, server_many, server_stream
from bench.serverproc import ServerProcess


def run_batch(eng, batch, prompts: list[list[int]], tokens: int, stagger: bool) -> float:
    """Aggregate tokens/s of `prompts` through the batch, added at once or one per step;
    one prompt: its decode rate after the first token (as `Raw.stream` measures it)."""
    waiting = [(f"s{i}", greedy(eng, f"s{i}", p, tokens)) for i, p in enumerate(prompts)]
    n = 0
    t0 = first = time.perf_counter()
    while waiting or batch.members:
        while waiting:
            rid, prep = waiting.pop(0)
            batch.add(Seq(rid), prep)
            if stagger:
                break
        got = sum(1 for _, out in batch.step() if not isinstance(out, Exception))
        if got and not n:
            first = time.perf_counter()
        n += got
    if len(prompts) == 1:
        return (n - 1) / (time.perf_counter() - first)
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dtype", default=None)
    p.add_argument("--profile", action="store_true", help="cProfile one in-process run")
    p.add_argument("--server-args", default="--max-batch-size 32 --prefill-batch-size 8",
                   help="mlxd flags")
    a = p.parse_args()
    import mlx.core as mx

    dtype = a.dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")
    path = build(a.shape, dtype)
    rng = random.Random(0)

    def prompts():
        return [[rng.randrange(10, 4000) for _ in range(32)] for _ in range(a.streams)]

    raw = Raw(path)
    eng, batch = in_process(path, max_size=32)
    got: dict[str, list[float]] = {k: [] for k in ("raw", "at once", "staggered", "server")}
    one = a.streams == 1  # raw: stream_generate's decode rate, not batch_generate's
    for _ in range(a.rounds + 1):
        got["raw"].append(raw.stream(prompts()[0], a.tokens)[1] if one
                          else raw.batch(prompts(), a.tokens))
        got["at once"].append(run_batch(eng, batch, prompts(), a.tokens, stagger=False))
        got["staggered"].append(run_batch(eng, batch, prompts(), a.tokens, stagger=True))
    with ServerProcess([str(path)], *a.server_args.split()) as srv:
        srv.wait_healthy(timeout=900)
        for _ in range(a.rounds + 1):
            got["server"].append(server_stream(srv.port, str(path), prompts()[0], a.tokens)[1]
                                 if one else server_many(srv.port, str(path), prompts(), a.tokens))

    base = statistics.median(got["raw"][1:])
    print(f"{a.shape} {dtype} on {mx.default_device()}: {a.streams} streams x {a.tokens} "
          f"tokens, aggregate tok/s (median of {a.rounds} [min-max])")
    for name, xs in got.items():
        m = statistics.median(xs[1:])
        print(f"  {name:<10} {m:8.1f} [{min(xs[1:]):.1f}-{max(xs[1:]):.1f}]  "
              f"{m / base:.3f} x raw")
    if a.profile:
        prof = cProfile.Profile()
        prof.runcall(run_batch, eng, batch, prompts(), a.tokens, False)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
