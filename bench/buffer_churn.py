"""Buffers allocated anew per decode step of one long stream, in mlxd's batch in this
process, under a buffer cache limit as a worker sets one: what MLX's cache fails to serve.

    python -m bench.buffer_churn [--shape 0.5b] [--limit-mib 64] [--prompt 2000]
        [--tokens 700] [--min-bytes 262144] [--window 100]

MLX keeps freed buffers for reuse up to a limit, evicts nothing to make room, and reuses
a cached buffer only for a request of at least half its size, so a cache filled with
buffers of sizes not asked for again (a prefill's, a KV cache's outgrown ones) sends a
step's own back to the system and the next step allocates them again
(worker/loop/sizing.py `CacheRoom`). Counted here with a malloc interposer (Linux: a
shim compiled with the system's C compiler and preloaded; MLX's CPU allocator mallocs
every buffer it does not find cached): allocations of at least `--min-bytes` per step,
averaged over windows of `--window` steps. The steps where the KV outgrows its buffers
count their new ones (one per layer's keys and values): the rest is the cache's misses.
The batch's step memory and the floor are measured as at a worker's load; the limit is
`--limit-mib` or the floor, the larger.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>
static void *(*real)(size_t) = 0;
static atomic_long big = 0;
static long least = -1;
long churn_count(void) { return atomic_load(&big); }
void *malloc(size_t n) {
  if (!real) real = dlsym(RTLD_NEXT, "malloc");
  if (least < 0) { const char *e = getenv("CHURN_MIN_BYTES"); least = e ? atol(e) : 262144; }
  if ((long)n >= least) atomic_fetch_add(&big, 1);
  return real(n);
}
"""


def shim() -> Path:
    """The interposer, built once into the temporary directory."""
    path = Path(tempfile.gettempdir()) / "mlxd-churn-shim.so"
    if not path.exists():
        src = path.with_suffix(".c")
        src.write_text(SHIM)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(path), str(src), "-ldl"],
                       check=True)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--limit-mib", type=int, default=64)
    p.add_argument("--prompt", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=700)
    p.add_argument("--min-bytes", type=int, default=256 << 10)
    p.add_argument("--window", type=int, default=100)
    args = p.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("counts allocations with an LD_PRELOAD shim: Linux only")
    lib = shim()
    if str(lib) not in os.environ.get("LD_PRELOAD", ""):
        from supervisor.workers import blas
        preload = " ".join(filter(None, [str(lib), blas.preload(os.environ).get(
            "LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))]))
        os.execve(sys.executable, sys.orig_argv, {**os.environ, "LD_PRELOAD": preload,
                                                   "CHURN_MIN_BYTES": str(args.min_bytes)})
    count = ctypes.CDLL(str(lib)).churn_count
    count.restype = ctypes.c_long

    import mlx.core as mx

    from bench.gpu import SHAPES, build, default_dtype
    from bench.inprocess import Seq, greedy, in_process
    from worker.loop.sizing import StepMemory

    rows = 8
    eng, batch = in_process(build(args.shape, default_dtype(None)), prompt_cache=0,
                            max_size=rows)
    batch.step_memory = StepMemory.measure(eng.model, eng.vocab_size or 0, rows=rows)
    floor = batch.step_memory.decode(rows)  # (worker/loading/startup.py bound_memory)
    limit = max(floor, args.limit_mib << 20)
    batch.cache_room.limit, batch.cache_room.need = limit, floor
    mx.set_cache_limit(limit)
    mx.clear_cache()
    rng = random.Random(0)
    ids = [rng.randrange(3, SHAPES[args.shape]["vocab_size"]) for _ in range(args.prompt)]
    batch.add(Seq("a"), greedy(eng, "a", ids, args.tokens))
    per, last = [], count()
    while batch.members:
        batch.step()
        now = count()
        per.append(now - last)
        last = now
    w = args.window
    print(f"{args.shape}: cache limit {limit >> 20} MiB (floor {floor >> 10} KiB), a "
          f"{args.prompt}-token prompt, {len(per)} steps; allocations of {args.min_bytes} "
          f"bytes or more per step, by windows of {w} steps:")
    print("  " + " ".join(f"{sum(per[i:i + w]) / len(per[i:i + w]):.2f}"
                          for i in range(0, len(per), w)))
    print(f"  cache at the end: {mx.get_cache_memory() >> 10} KiB")


if __name__ == "__main__":
    main()
