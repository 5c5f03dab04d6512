"""Where concurrent streams' decode time goes: raw mlx-lm `batch_generate`, mlxd's batch
in-process (no HTTP, no worker process), and the server, on one model in one run.

    python -m bench.decode_probe [--shape 0.5b] [--streams 8] [--rounds 3] [--profile] [--where]
    python -m bench.decode_probe --model bench/models/2b-vision-gemma4-bfloat16-as-text

With `--streams 1` every figure is one stream's decode rate after its first token, raw
being `stream_generate` (mlx-lm's single-sequence path, not its batch).

The in-process batch runs twice: every stream added at once (as raw `batch_generate`
does), and one stream added per step (as a server sees requests that arrive a few
milliseconds apart: later prompts are prefilled while the first decode, and the batch
pads and merges). The gap raw → batch-at-once is mlxd's batch itself (its decoding of
each token: detokenizer, stops, the first-token read); batch-at-once → batch-staggered
is what arrival order costs; batch-staggered → server is HTTP, IPC and the worker's
threads. `--profile` prints where the batch's Python time goes (cProfile, one run).
`--where` splits one more run of each in-process kind into its steps that admit a
sequence (join), that end one (leave) and the others, with the methods that took their
time (mlx-lm's batches and caches, mlxd's batch and prefix cache, mx.eval).
Figures are aggregate tokens/s, medians of rounds (the first dropped: compiles).
"""

from __future__ import annotations

import argparse
import json
import collections
import cProfile
import importlib
import pstats
import random
import statistics
from pathlib import Path
import time

from bench.gpu import Raw, build, default_dtype, server_many, server_stream
from bench.inprocess import Seq, greedy, in_process, time_methods
from bench.serverproc import ServerProcess


def steps(eng, batch, prompts: list[list[int]], tokens: int, stagger: bool):
    """Yields once per step for the caller to take, until `prompts` are done: before each,
    what joins there is added (every prompt at once, or one per step)."""
    waiting = [(f"s{i}", greedy(eng, f"s{i}", p, tokens)) for i, p in enumerate(prompts)]
    while waiting or batch.members:
        while waiting:
            rid, prep = waiting.pop(0)
            batch.add(Seq(rid), prep)
            if stagger:
                break
        yield


def run_batch(eng, batch, prompts: list[list[int]], tokens: int, stagger: bool) -> float:
    """Aggregate tokens/s of `prompts` through the batch, added at once or one per step;
    one prompt: its decode rate after the first token (as `Raw.stream` measures it)."""
    n = 0
    t0 = first = time.perf_counter()
    for _ in steps(eng, batch, prompts, tokens, stagger):
        got = sum(1 for _, out in batch.step() if not isinstance(out, Exception))
        if got and not n:
            first = time.perf_counter()
        n += got
    if len(prompts) == 1:
        return (n - 1) / (time.perf_counter() - first)
    return n / (time.perf_counter() - t0)


METHODS: dict[str, list] = {}  # label -> [seconds, calls] while `where` runs a step


def where(eng, batch, prompts: list[list[int]], tokens: int, stagger: bool) -> None:
    """One run through the batch, its wall time split by kind of step, with the methods
    that took the join and leave steps' time."""
    spent = collections.Counter()
    by_step: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    calls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    gen = batch.gen
    for _ in steps(eng, batch, prompts, tokens, stagger):
        joining = bool(gen._unprocessed_sequences or len(gen._prompt_batch))
        members = len(batch.members)
        METHODS.clear()
        t = time.perf_counter()
        batch.step()
        kind = "join" if joining else "leave" if len(batch.members) < members else "other"
        spent[kind] += time.perf_counter() - t
        for label, (s, n) in METHODS.items():
            by_step[kind][label] += s
            calls[kind][label] += n
    print(f"  {'staggered' if stagger else 'at once'}: " + ", ".join(
        f"{k} steps {1000 * spent[k]:.0f} ms" for k in ("join", "other", "leave")))
    for kind in ("join", "leave"):
        top = by_step[kind].most_common(10)
        print(f"    {kind}: " + "; ".join(f"{label} {1000 * s:.1f} ms/{calls[kind][label]}"
                                        for label, s in top))


def _time_batch_methods() -> None:
    import mlx.core as mx
    from mlx_lm.models import cache

    from worker.loop import batch as wb

    from worker.kvcache import prefix as prefix_cache

    g = importlib.import_module("mlx_lm.generate")

    def sink(label, seconds):
        got = METHODS.setdefault(label, [0.0, 0])
        got[0] += seconds
        got[1] += 1
    time_methods([(g.PromptProcessingBatch, ("split", "prompt", "filter", "extract_cache")),
                  (g.GenerationBatch, ("__init__", "_step", "extend", "filter", "extract_cache")),
                  (cache.BatchKVCache, ("extract", "filter", "extend", "merge")),
                  (wb.Batch, ("_store", "_first_tokens")),
                  (prefix_cache.PrefixCache, ("store", "trim_to")),
                  (mx, ("eval", "async_eval", "clear_cache"))], sink)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--model", default=None, help="a text model's directory instead of a "
                   "shape (e.g. a vision checkpoint's text copy: bench/vision_throughput.py)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dtype", default=None)
    p.add_argument("--profile", action="store_true", help="cProfile one in-process run")
    p.add_argument("--where", action="store_true",
                   help="split one more in-process run of each kind by kind of step")
    p.add_argument("--server-args", default="--max-batch-size 32 --prefill-batch-size 8",
                   help="mlxd flags")
    a = p.parse_args()
    import mlx.core as mx

    dtype = default_dtype(a.dtype)
    path = Path(a.model) if a.model else build(a.shape, dtype)
    vocab = json.loads((path / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab.get("text_config", {}).get("vocab_size", 4096)
    rng = random.Random(0)

    def prompts():
        return [[rng.randrange(10, min(4000, vocab)) for _ in range(32)]
                for _ in range(a.streams)]

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
    print(f"{path.name if a.model else a.shape} {dtype} on {mx.default_device()}: {a.streams} streams x {a.tokens} "
          f"tokens, aggregate tok/s (median of {a.rounds} [min-max])")
    for name, xs in got.items():
        m = statistics.median(xs[1:])
        print(f"  {name:<10} {m:8.1f} [{min(xs[1:]):.1f}-{max(xs[1:]):.1f}]  "
              f"{m / base:.3f} x raw")
    if a.where:
        _time_batch_methods()
        print("  where the in-process batch's time goes (one run each):")
        where(eng, batch, prompts(), a.tokens, stagger=False)
        where(eng, batch, prompts(), a.tokens, stagger=True)
    if a.profile:
        prof = cProfile.Profile()
        prof.runcall(run_batch, eng, batch, prompts(), a.tokens, False)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
