"""One decode step of a Gemma 4 checkpoint's language model, by what runs it (issue 33):
mlx-lm's text class (what mlxd's vision batch runs: worker/vision/language.py) on plain
caches and in mlx-lm's BatchGenerator (prompts of equal and unequal lengths: the batch's
masks and caches), beside mlx-vlm's own language model on plain caches, at 1 and 8 rows;
ms a step, pipelined as mlx-lm decodes, the best of 3.

    python -m bench.vision_step [tiny|small|2b] [steps]

On a lent H200 (2b, bf16) the BatchGenerator's 8-row step (25.5 ms) was no dearer than
mlx-vlm's model on plain caches (29.1 ms): the 0.46 x of the served 8-stream row is not
the batch's decode step (docs/benchmarks.md, session 11)."""
from __future__ import annotations

import sys
import time

import mlx.core as mx

from bench.make_model import MODELS_DIR

REPS = 3


def plain(model, rows: int, call, steps: int) -> float:
    """ms a step of `model` on its own caches (no mask at decode), `rows` equal rows."""
    from mlx_lm.models.cache import make_prompt_cache

    best = 1e9
    for _ in range(REPS):
        cache = model.make_cache() if hasattr(model, "make_cache") else make_prompt_cache(model)
        prompt = mx.array([list(range(5, 69))] * rows)
        mx.eval(call(model, prompt, cache))
        y = mx.argmax(call(model, prompt[:, -1:], cache)[:, -1], axis=-1)
        mx.async_eval(y)
        t = time.perf_counter()
        for _ in range(steps):
            following = mx.argmax(call(model, y[:, None], cache)[:, -1], axis=-1)
            mx.async_eval(following)
            y.tolist()
            y = following
        y.tolist()
        best = min(best, (time.perf_counter() - t) / steps)
    return best * 1e3


def lm_call(model, x, cache):
    return model(x, cache=cache)


def vlm_call(model, x, cache):
    out = model(x, cache=cache)
    return getattr(out, "logits", out)


def batch_generator(lm, rows: int, equal: bool, steps: int) -> float:
    """ms a step of mlx-lm's BatchGenerator (with mlxd's patches) at `rows` rows."""
    import worker.loop.mlx_lm_patches  # noqa: F401  (as the worker has them)
    from mlx_lm.generate import BatchGenerator

    best = 1e9
    for _ in range(REPS):
        gen = BatchGenerator(lm, max_tokens=steps + 16, stop_tokens=set())
        gen.insert([list(range(5, 69 if equal else 40 + 5 * i)) for i in range(rows)])
        for _ in range(6):
            gen.next()
        t = time.perf_counter()
        for _ in range(steps):
            gen.next()
        best = min(best, (time.perf_counter() - t) / steps)
        gen.close()
    return best * 1e3


def main() -> None:
    from mlx_vlm.utils import load_model

    from worker.demos.vision import build_vision_model
    from worker.vision.language import shared_language_model

    size = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
    path = MODELS_DIR / f"vision-step-{size}-{dtype}"
    build_vision_model(path, size, family="gemma4", dtype=dtype)
    vlm = load_model(path)
    lm = shared_language_model(vlm, path)
    print("MLX", mx.__version__, dtype, size, flush=True)
    for name, f in [
            ("mlx-lm class, plain caches, 1 row", lambda: plain(lm, 1, lm_call, steps)),
            ("mlx-lm class, plain caches, 8 rows", lambda: plain(lm, 8, lm_call, steps)),
            ("mlx-vlm LM, plain caches, 1 row",
             lambda: plain(vlm.language_model, 1, vlm_call, steps)),
            ("mlx-vlm LM, plain caches, 8 rows",
             lambda: plain(vlm.language_model, 8, vlm_call, steps)),
            ("mlx-lm BatchGenerator, 1 row", lambda: batch_generator(lm, 1, True, steps)),
            ("mlx-lm BatchGenerator, 8 rows equal", lambda: batch_generator(lm, 8, True, steps)),
            ("mlx-lm BatchGenerator, 8 rows unequal",
             lambda: batch_generator(lm, 8, False, steps))]:
        print(f"  {name:42} {f():8.2f} ms a step", flush=True)


if __name__ == "__main__":
    main()
