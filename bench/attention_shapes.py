"""A prompt pass after cached keys at key counts new and seen, by three attentions: MLX's as
it is (cuDNN's fused attention on CUDA, its graph built per shape), MLX's with cuDNN's off
for the process (MLX_CUDA_USE_CUDNN_SDPA=0: its fallback of matmuls and a softmax), and
mlxd's per-call choice (worker/loop/cuda_attention.py: the fallback for a pass after
cached keys, cuDNN for the rest). Each in a process of its own (MLX reads the setting
once), on a random-weight model of bench/gpu.py's shapes, its forward called directly.

    python -m bench.attention_shapes [--shape 0.5b] [--queries 128]
    python -m bench.attention_shapes --decode 1000,4000,16000 [--shape 0.5b] [--rounds 4]

Rows: a pass of `--queries` tokens after ~2,000 cached at a key count seen before, and at
counts new each time (and new multiples of 128); a cold 2,048- and 8,192-token prompt in
chunks of 2,048 (shapes seen); one stream's decode from 1,000 tokens for 300 (its key
count crosses the cache's 256-token steps). Medians in ms (decode: tokens/s), and each
side against MLX's as it is. On Metal and the CPU nothing is built per shape and mlxd's
choice is not installed: the sides should agree there.

`--decode`: one stream's decode of 200 tokens after each context on plain caches growing
256 tokens at a time (mlx-lm's step: MLX decodes by cuDNN, keys sliced from a buffer of a
multiple of 256), `cuda_attention.DECODE_STEP` at a time (MLX's vector kernel), and by
mlxd's rule (`cuda_attention.Growth`: the vector kernel on short keys, cuDNN on long), in
one process, rounds alternating: the medians and the paired ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

SIDES = {"MLX": {}, "MLX, cuDNN off": {"MLX_CUDA_USE_CUDNN_SDPA": "0"}, "mlxd": {}}


def prefilled(model, ids: list[int], n: int, chunk: int, step: int | None = None):
    """A plain prompt cache holding `ids[:n]`, filled `chunk` tokens a pass, its layers
    growing `step` tokens at a time where given (else mlx-lm's 256); and the ms it took."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for c in cache if step else ():
        c.step = step
    t = time.perf_counter()
    for a in range(0, n, chunk):
        model(mx.array([ids[a:min(n, a + chunk)]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache, (time.perf_counter() - t) * 1e3


def decoded(model, cache, first: int, count: int) -> float:
    """Tokens/s of `count` greedy steps on `cache` from the token `first`."""
    import mlx.core as mx

    y = mx.array([[first]])
    t = time.perf_counter()
    for _ in range(count):
        y = mx.argmax(model(y, cache=cache)[:, -1:, :], axis=-1)
        mx.eval(y)
    return count / (time.perf_counter() - t)


def measure(shape: str, side: str, queries: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    from bench.gpu import SHAPES, build, default_dtype

    if side == "mlxd":
        from worker.loop import cuda_attention
        cuda_attention.install()
    model, _ = load(str(build(shape, default_dtype(None))))
    rng = random.Random(0)
    ids = [rng.randrange(3, SHAPES[shape]["vocab_size"]) for _ in range(9000)]

    def fill(n, chunk=2048):
        return prefilled(model, ids, n, chunk)

    def warm(n):
        cache, _ = fill(n, 1024)
        t = time.perf_counter()
        mx.eval(model(mx.array([ids[n:n + queries]]), cache=cache))
        return (time.perf_counter() - t) * 1e3

    def decode(n, tokens=300):
        return decoded(model, fill(n, 1024)[0], ids[n], tokens)

    warm(2048), warm(2048)
    out = {"warm, key count seen": [warm(2048) for _ in range(5)],
           "warm, key count new": [warm(1500 + 37 * i) for i in range(1, 11)],
           "warm, new multiples of 128": [warm(1024 + 128 * i) for i in range(1, 9)]}
    for n in (2048, 8192):
        fill(n), fill(n)
        out[f"cold {n}"] = [fill(n)[1] for _ in range(4)]
    decode(1000, 20)
    out["decode from 1,000 (tok/s)"] = [decode(1000) for _ in range(3)]
    return {k: statistics.median(v) for k, v in out.items()}


def decode_by_step(shape: str, contexts: list[int], rounds: int, tokens: int = 200) -> list:
    """Rows of tok/s at each context: caches growing 256 tokens at a time, DECODE_STEP at a
    time, and by mlxd's rule (cuda_attention.Growth), rounds alternating."""
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache

    from bench.gpu import SHAPES, build, default_dtype
    from bench.report import alternate
    from worker.loop import cuda_attention

    step = cuda_attention.DECODE_STEP
    model, _ = load(str(build(shape, default_dtype(None))))
    KVCache.step = cuda_attention.Growth()  # (the sides with a step of their own set it)
    rng = random.Random(0)
    ids = [rng.randrange(3, SHAPES[shape]["vocab_size"]) for _ in range(max(contexts) + 1)]

    def run(n, cache_step, count=tokens):
        return decoded(model, prefilled(model, ids, n, 2048, cache_step)[0], ids[n], count)

    sides = {"256": 256, str(step): step, "mlxd": None}
    rows = []
    for n in contexts:
        for s in sides.values():
            run(n, s, 20)  # (each side's shapes met once)
        got = alternate(rounds, {name: lambda _, s=s: run(n, s) for name, s in sides.items()},
                        log=None)
        med = {name: statistics.median(got.figures[name]) for name in sides}
        vector, _, _ = got.ratio(str(step), "256")
        mean, low, high = got.ratio("mlxd", "256")
        by_vector, _, _ = got.ratio("mlxd", str(step))
        rows.append((f"{shape} decode after {n:,}",
                     f"step 256 (cuDNN) {med['256']:.1f} tok/s, step {step} (vector) "
                     f"{med[str(step)]:.1f}, mlxd {med['mlxd']:.1f}",
                     f"vector / cuDNN {vector:.3f}; mlxd / cuDNN {mean:.3f} "
                     f"[{low:.3f}-{high:.3f}], mlxd / vector {by_vector:.3f}"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--queries", type=int, default=128)
    p.add_argument("--side", help=argparse.SUPPRESS)  # (one side, in its own process)
    p.add_argument("--decode", default=None, metavar="CONTEXTS",
                   help="decode by cache step after these contexts, e.g. 1000,4000")
    p.add_argument("--rounds", type=int, default=4, help="of --decode")
    a = p.parse_args()
    if a.decode:
        from bench.report import print_table
        print_table(f"{a.shape}: one stream's decode by the caches' step",
                    decode_by_step(a.shape, [int(n) for n in a.decode.split(",")], a.rounds))
        return
    if a.side:
        print(json.dumps(measure(a.shape, a.side, a.queries)))
        return
    got = {}
    for side, env in SIDES.items():
        r = subprocess.run([sys.executable, "-m", "bench.attention_shapes", "--shape", a.shape,
                            "--queries", str(a.queries), "--side", side],
                           env={**os.environ, **env}, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{side} failed:\n{r.stderr[-3000:]}")
        got[side] = json.loads(r.stdout.strip().splitlines()[-1])
    import mlx.core as mx
    from bench.report import print_table

    info = mx.device_info()
    rows = []
    for row in got["MLX"]:
        cells = ", ".join(f"{side} {got[side][row]:.1f}" for side in SIDES)
        ratios = ", ".join(f"{side} {got[side][row] / got['MLX'][row]:.2f}" for side in SIDES
                           if side != "MLX")
        rows.append((row, cells, f"x MLX's: {ratios}"))
    print_table(f"{a.shape} on {info.get('device_name', info)} (MLX {mx.__version__}): a "
                f"{a.queries}-token pass after cached keys, cold prompts, decode "
                "(medians, ms; decode tok/s)", rows)


if __name__ == "__main__":
    main()
