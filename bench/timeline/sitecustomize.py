"""The worker's timeline, for bench/worker_timeline.py: imported by every Python process
started with this folder on PYTHONPATH, it does anything only with MLXD_TRACE set (a
path prefix) and only in a process that imports the worker's scheduler. There it wraps
the scheduler's and the batch's methods, unchanged otherwise, to write one line an event
to `MLXD_TRACE.<pid>`: `<monotonic s> <event> <fields>` (commands handled, preparations,
admissions, steps with the batch's counts before them, a vision batch's image prefill
chunks, flushes, finishes, settles).
CLOCK_MONOTONIC is system-wide, so the lines merge with the client's own times.

MLXD_GATHER (seconds), when set, replaces the worker's GATHER (worker/loop/gathering.py): the same build run with
the gather off and on, side by side. MLXD_SWITCH (seconds), when set, is the worker's
`sys.setswitchinterval`: how long a thread that wants the GIL waits before it asks the
holder for it (the MLX thread launching a step and the I/O threads sending its tokens).
MLXD_PREPARERS, when set, replaces the scheduler's PREPARERS (its preparation threads).
MLXD_TRACE_PHASES=1 also times the phases of a step (`PHASES`: a prompt's cached state put
into the batch, its prefill and first token, a join, a decode step, a state kept or
stored), each between two `mx.synchronize()`: what the device spent on each, at the price
of the step's overlap of host and device (issue 33: where a warm request's step of 60 ms
goes on a GPU, where the same step takes 3 ms on this CPU)."""
import importlib.abc
import importlib.util
import os
import sys
import threading
import time

PATH = os.environ.get("MLXD_TRACE")
_lock = threading.Lock()
_out = None


def event(*fields) -> None:
    global _out
    with _lock:
        if _out is None:
            _out = open(f"{PATH}.{os.getpid()}", "a", buffering=1)
        _out.write(f"{time.monotonic():.6f} " + " ".join(str(f) for f in fields) + "\n")


def _ms(t0: float) -> str:
    return f"{(time.monotonic() - t0) * 1e3:.2f}"


def patch(mod) -> None:
    from worker.loop import batch as batch_mod
    from worker.loop import preparer

    from worker.loop import gathering

    if os.environ.get("MLXD_GATHER"):
        gathering.GATHER = float(os.environ["MLXD_GATHER"])
    event("gather", gathering.GATHER)
    if os.environ.get("MLXD_PREPARERS"):
        mod.PREPARERS = int(os.environ["MLXD_PREPARERS"])
    event("preparers", mod.PREPARERS)
    if os.environ.get("MLXD_SWITCH"):
        sys.setswitchinterval(float(os.environ["MLXD_SWITCH"]))
    event("switch", sys.getswitchinterval())
    S, B = mod.Scheduler, batch_mod.Batch
    handle, admit, flush, finish = S._handle, S._admit, S._flush, S._finish
    step, settle, prepare = B.step, B.settle, preparer.prepare

    def _handle(self, cmd):
        seq = getattr(cmd, "seq", None)
        event("cmd", type(cmd).__name__, getattr(cmd, "rid", getattr(seq, "rid", "-")))
        return handle(self, cmd)

    def _admit(self, seq):
        t0 = time.monotonic()
        admit(self, seq)
        event("admit", seq.rid, seq.prompt_tokens, _ms(t0))

    def _flush(self, seq):
        event("flush", seq.rid, seq.completion_tokens)
        return flush(self, seq)

    def _finish(self, seq, reason, **kw):
        event("finish", seq.rid, seq.completion_tokens)
        return finish(self, seq, reason, **kw)

    def _step(self):
        g = self.gen
        counts = (len(g._unprocessed_sequences), len(g._prompt_batch),
                  len(g._generation_batch))
        t0 = time.monotonic()
        out = step(self)
        event("step", _ms(t0), "waiting/prefilling/decoding", *counts, "out", len(out))
        return out

    def _settle(self):
        n, t0 = len(self._ended), time.monotonic()
        settle(self)
        if n:
            event("settle", n, _ms(t0))

    def _prepare(self, gen):
        t0 = time.monotonic()
        out = prepare(self.engine, self.batch.kvcache, gen)
        event("prepare", gen.rid, _ms(t0))
        return out

    S._handle, S._admit, S._flush, S._finish, S._prepare = (
        _handle, _admit, _flush, _finish, _prepare)
    B.step, B.settle = _step, _settle


def patch_vision(mod) -> None:
    """A vision worker's image prefill: each prompt's vision tower, its chunks one by one,
    and the image prompts prefilled together (worker/vision/group.py)."""
    V = mod.VisionBatch
    chunk, embed, together = V._prefill_chunk, V._embed, V._together

    def _prefill_chunk(self, job, size):
        t0, start = time.monotonic(), job.pos
        n = chunk(self, job, size)
        event("image-chunk", _ms(t0), job.seq.rid, f"{start}-{start + n}", "of", job.end)
        return n

    def _embed(self, job, features=None):
        t0, fresh = time.monotonic(), job.cache is None
        embed(self, job, features)
        if fresh:  # (given its features: the tower ran for several, below)
            event("vision-tower" if features is None else "embedding", _ms(t0), job.seq.rid)

    def encode(vlm, jobs):
        t0 = time.monotonic()
        out = encode_together(vlm, jobs)
        if any(f is not None for f in out):
            event("vision-tower-together", _ms(t0),
                  f"{sum(f is not None for f in out)} prompts")
        return out

    def _together(self, budget):
        t0 = time.monotonic()
        n = together(self, budget)
        if n:
            event("images-together", _ms(t0), f"{n} tokens")
        return n

    V._prefill_chunk, V._embed, V._together = _prefill_chunk, _embed, _together
    encode_together, mod.towers.encode = mod.towers.encode, encode


# (module, class, method) timed by MLXD_TRACE_PHASES, each a line "phase <name> <ms>".
PHASES = [("worker.loop.batch", "Batch", m)
          for m in ("insert", "_checkpoint", "_store", "_first_tokens")] + [
    ("mlx_lm.generate", "PromptProcessingBatch", "prompt"),
    ("mlx_lm.generate", "PromptProcessingBatch", "generate"),
    ("mlx_lm.generate", "GenerationBatch", "extend"),
    ("mlx_lm.generate", "GenerationBatch", "_step"),
]


def patch_phases(mod) -> None:
    """Times PHASES' methods of `mod`, each between two synchronizations."""
    import mlx.core as mx

    for where, cls, name in PHASES:
        if where != mod.__name__:
            continue
        klass = getattr(mod, cls)
        run = getattr(klass, name)

        def timed(self, *args, _run=run, _label=f"{cls}.{name}", **kw):
            mx.synchronize()
            t0 = time.monotonic()
            out = _run(self, *args, **kw)
            if isinstance(out, (list, tuple)):
                mx.eval([x for x in out if isinstance(x, mx.array)])
            mx.synchronize()
            event("phase", _label, _ms(t0))
            return out

        setattr(klass, name, timed)


PATCHES = {"worker.loop.scheduler": patch, "worker.vision.batch": patch_vision}
if os.environ.get("MLXD_TRACE_PHASES"):
    for _where in {where for where, _, _ in PHASES}:
        _then = PATCHES.get(_where)
        PATCHES[_where] = (lambda m, _then=_then: (_then(m) if _then else None,
                                                   patch_phases(m)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches each module of PATCHES once it has been executed."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if PATH:
    sys.meta_path.insert(0, _AfterImport())
