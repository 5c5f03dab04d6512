"""--quantized-kv-start (worker/kvcache/quantized.py KVFormat.start) with the real batch on
the tiny float32 model of test_worker_kv_quant: a short sequence keeps full precision (the
full-precision text, a plain state stored), a long one converts once it passes the start,
a batch converts as a whole (a plain sequence that joins a quantized batch is quantized as
it joins), the start is part of a snapshot's identity, and the budget bounds the bytes."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from tests.worker.batchrun import make_batch, run_all
from tests.worker.test_worker_kv_quant import (SYSTEM, ids_gen, kvq,  # noqa: F401 (a fixture)
                                                run_one, tokens)
from worker.kvcache.prefix import PrefixCache
from worker.kvcache.quantized import KVFormat
from worker.loading.startup import kv_size
from worker.loop.sizing import KVSize

S8 = KVFormat(8, 32, start=64)
SHORT, LONG = SYSTEM[:20], SYSTEM + [1, 2]


def stored(batch, ids) -> type:
    return type(batch.kvcache.prefix.fetch("", ids).cache[0])


def test_a_short_sequence_stays_full_precision_and_a_long_one_converts(kvq):
    engine, _ = kvq
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), kv_format=S8)
    _, out = run_one(batch, engine, ids_gen(SHORT))
    assert out == run_one(make_batch(engine), engine, ids_gen(SHORT))[1]
    assert stored(batch, SHORT) is KVCache
    # The long prompt starts from the short one's plain prefix and passes the start.
    cached, out = run_one(batch, engine, ids_gen(LONG))
    assert cached == len(SHORT) and out
    assert stored(batch, LONG) is QuantizedKVCache
    # The batch is empty again: the next short sequence is full precision.
    run_one(batch, engine, ids_gen(SHORT + [5]))
    assert stored(batch, SHORT + [5]) is KVCache


def test_a_batch_converts_as_a_whole(kvq):
    """Prefilled together, the long prompt converts the short one's rows too; a short one
    that joins the quantized batch later is quantized as it joins."""
    engine, _ = kvq
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), kv_format=S8)
    a, b = SHORT + [7], SHORT + [8]
    preps = {"long": engine.prepare(ids_gen(LONG, "long", max_tokens=12)),
             "a": engine.prepare(ids_gen(a, "a", max_tokens=12)),
             "b": engine.prepare(ids_gen(b, "b", max_tokens=4))}
    out = run_all(batch, preps, join={"b": 5})
    assert all(tokens(out[n]) for n in preps)
    assert stored(batch, a) is QuantizedKVCache and stored(batch, b) is QuantizedKVCache


def test_the_start_is_in_the_identity_and_the_budget_bounds_the_bytes(kvq):
    engine, _ = kvq
    assert S8.tag == "q8g32s64" and KVFormat(8, 32).tag == "q8g32"
    full, q8 = KVSize.measure(engine.model), KVSize.measure(engine.model,
                                                            kv_format=KVFormat(8, 32))
    kv = kv_size(engine.model, None, S8)
    assert kv.per_token == q8.per_token
    for n in (1, 64, 65, 1000):  # full precision up to the start, 8 bits after
        assert kv.of(n) >= (full if n <= 64 else q8).of(n)
    assert kv.of(1000) < full.of(1000) / 2


def test_a_lone_sequence_that_decodes_past_the_start_converts(kvq):
    """A short prompt alone in the batch decodes on plain views of its caches
    (worker/loop/mlx_lm_patches.py); once its length passes the start, it is quantized all
    the same (its final state stored quantized), and it keeps decoding."""
    engine, _ = kvq
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), kv_format=S8)
    _, out = run_one(batch, engine, ids_gen(SHORT, max_tokens=60))
    assert len(out) == 60 and len(SHORT) < S8.start < len(SHORT) + len(out)
    longest = max(batch.kvcache.prefix._lru.items(), key=lambda kv: len(kv[0][1]))
    assert len(longest[0][1]) > S8.start and type(longest[1].cache[0]) is QuantizedKVCache
