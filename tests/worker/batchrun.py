"""Run prepared requests through the real batch (worker/loop/batch.py) in-process, for tests.

The worker's scheduler does the same with commands, Deltas and Done around it; these
helpers drive `Batch.step` directly, so a test sees each sequence's step outcomes:
`(token, text, finish, extra)` (worker/text/decoding.py), or the exception that ended it.
"""

from __future__ import annotations

from worker.kvcache.disk import DiskTier
from worker.kvcache.manager import SNAPSHOT_EVERY, KVCache, trimmable
from worker.kvcache.prefix import PrefixCache
from worker.kvcache.quantized import KVFormat
from worker.loop.batch import Batch
from worker.loop.sizing import KVSize


def forward_shapes(monkeypatch, cls) -> list[tuple]:
    """The input shapes of every forward pass of model class `cls` from here on (the
    patch undone with the test's monkeypatch)."""
    shapes = []
    own = cls.__call__

    def spy(self, inputs, *a, **kw):
        shapes.append(tuple(inputs.shape))
        return own(self, inputs, *a, **kw)

    monkeypatch.setattr(cls, "__call__", spy)
    return shapes


class Seq:
    """What the batch needs of the scheduler's Sequence."""

    def __init__(self, name):
        self.rid = name
        self.uid = None


def make_batch(engine, *, max_size: int = 8, prefill_batch: int = 8, kv_budget: int = 1 << 30,
               prefix: PrefixCache | None = None, max_kv_size: int | None = None,
               disk: DiskTier | None = None, snapshot_every: int = SNAPSHOT_EVERY,
               kv_format: KVFormat = KVFormat(), **kw) -> Batch:
    """A batch as worker/loading/startup.py builds one; with `prefix`, its KV cache manager
    (the prefix cache, named snapshots and the `disk` tier: batch.kvcache)."""
    kvcache = None
    if prefix is not None:
        kvcache = KVCache(prefix, disk, trimmable=trimmable(engine.model, max_kv_size),
                          every=snapshot_every)
    return Batch(engine, max_size=max_size, prefill_step=engine.prefill_step,
                 prefill_batch=prefill_batch, kv_budget=kv_budget, kvcache=kvcache,
                 kv=KVSize.measure(engine.model, max_kv_size, kv_format), max_kv_size=max_kv_size,
                 kv_format=kv_format, **kw)


def steps(engine, prep, batch: Batch | None = None):
    """One request alone: None for each step that produced no token, then its outcomes.
    An exception that ended it is raised."""
    batch = make_batch(engine) if batch is None else batch
    seq = Seq("alone")
    batch.add(seq, prep)
    while len(batch):
        results = batch.step()
        if not results:
            yield None
        for _, out in results:
            if isinstance(out, Exception):
                raise out
            yield out


def run_all(batch: Batch, preps: dict, join: dict | None = None) -> dict:
    """Several requests in one batch, run to the end: {name: [outcomes]}. `join` maps a
    name to the number of steps to run before it joins (default: at once)."""
    join = join or {}
    seqs = {name: Seq(name) for name in preps}
    out = {name: [] for name in preps}
    waiting = sorted(preps, key=lambda n: join.get(n, 0))
    step = 0
    while waiting or len(batch):
        while waiting and join.get(waiting[0], 0) <= step:
            name = waiting.pop(0)
            batch.add(seqs[name], preps[name])
        for seq, outcome in batch.step():
            out[seq.rid].append(outcome)
        step += 1
    return out


def turn(engine, batch: Batch, ids: list[int], prediction: list[int] | None = None,
         max_tokens: int = 24, **kw) -> tuple[int, list[int]]:
    """One greedy request for the token ids `ids`, alone in `batch` to its end, drafting
    from `prediction` (token ids) if given: (the prompt tokens its cache supplied, the
    tokens it generated)."""
    from protocol.messages import pack_ids
    from tests.generates import generate

    prep = engine.prepare(generate(rid="t", prompt_ids=pack_ids(ids), max_tokens=max_tokens,
                                   temperature=0.0, **kw))
    prep.prediction = prediction
    cached = batch.add(Seq("t"), prep)
    out = []
    while batch.members:
        out += [o[0] for _, o in batch.step() if o[0] >= 0]
    return cached, out
