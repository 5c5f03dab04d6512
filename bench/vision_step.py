"""One decode step of a Gemma 4 checkpoint's language model, by what runs it (issue 33):
mlx-lm's text class (what mlxd's vision batch runs: worker/vision/language.py) on plain
caches and in mlx-lm's BatchGenerator (prompts of equal and unequal lengths: the batch's
masks and caches), beside mlx-vlm's own language model on plain caches, at 1 and 8 rows;
and the worker's own batch as `python -m worker` builds it (worker/loading/kinds.py:
the vision batch with its prefix cache, samplers, per-row `Decoding` and every patch),
eight chats decoding, which is the served path but the scheduler and the sockets; ms a
step, pipelined as mlx-lm decodes, the best of 3.

    python -m bench.vision_step [tiny|small|2b] [steps] [layers] [rows]

(`layers`: the size's but that many language layers: `tiny 32 56` is the 2b's depth at a
width whose step is all launches and Python, as a small model's step is on a GPU; ""
for the size's own. `rows`: only the rows whose name holds this text, e.g. "1 row".)

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


def worker_batch(path, rows: int, steps: int) -> float:
    """ms a step of the worker's own batch (`KINDS[kind].start`, as worker/__main__.py
    loads it) with `rows` greedy chats decoding: `Batch.step` as the scheduler calls it,
    each row's tokens fed to its `Decoding` (detokenized, stops checked)."""
    import tempfile

    from bench.inprocess import Seq
    from protocol import Generate, SamplingParams
    from protocol.settings import worker_parser
    from worker.loading import models
    from worker.loading.kinds import KINDS

    with tempfile.TemporaryDirectory() as state:
        args = worker_parser().parse_args([
            "--model", str(path), "--commands", "x", "--events", "y", "--epoch", "1",
            "--state-dir", state, "--max-batch-size", str(max(8, rows))])
        loaded = models.load(args.model, args.state_dir, args.max_context_tokens,
                             gguf_options=models.gguf_options(args))
        engine, batch = KINDS[loaded.kind].start(loaded, args)
        best = 1e9
        for rep in range(REPS):
            for i in range(rows):
                gen = Generate(rid=f"r{rep}-{i}", messages=[{"role": "user", "content":
                               f"Tell me story number {i} about " + "sea " * (1 + 2 * i)}],
                               sampling=SamplingParams(temperature=0.0,
                                                       max_tokens=steps + 64))
                batch.add(Seq(gen.rid), engine.prepare(gen))
            for _ in range(12):  # (every prompt read; a join's merge behind)
                batch.step()
            t = time.perf_counter()
            for _ in range(steps):
                batch.step()
            best = min(best, (time.perf_counter() - t) / steps)
            while len(batch):
                batch.step()
        batch.close()
    return best * 1e3


def main() -> None:
    from mlx_vlm.utils import load_model

    from worker.demos.vision import build_vision_model
    from worker.vision.language import shared_language_model

    size = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
    layers = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    only = sys.argv[4] if len(sys.argv) > 4 else ""
    path = MODELS_DIR / f"vision-step-{size}{f'-{layers}L' if layers else ''}-{dtype}"
    build_vision_model(path, size, family="gemma4", dtype=dtype, layers=layers)
    vlm = load_model(path)
    lm = shared_language_model(vlm, path)
    print("MLX", mx.__version__, dtype, size, f"{layers} layers" if layers else "",
          flush=True)
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
             lambda: batch_generator(lm, 8, False, steps)),
            ("the worker's batch, 1 row", lambda: worker_batch(path, 1, steps)),
            ("the worker's batch, 8 rows", lambda: worker_batch(path, 8, steps))]:
        if only in name:
            print(f"  {name:42} {f():8.2f} ms a step", flush=True)


if __name__ == "__main__":
    main()
