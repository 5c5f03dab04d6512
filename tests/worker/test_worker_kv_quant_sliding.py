"""--kv-bits on a sliding-window model (Gemma 3's layout: mlx-lm `gemma3_text`, a 16-token
window every other layer, worker/demos/text.py `tiny-sliding-kvq`): the global layers'
keys and values are quantized and the windows' rotating caches stay at full precision
(worker/kvcache/quantized.py), with the real batch: batched equals alone past the window,
a prefix reuse and a snapshot resume give the cold run's text in the same format, the
worker starts with it. (A model whose every layer is a window, --max-kv-size, has nothing
to quantize: a load error, tests/worker/test_worker_kv_quant.py.)"""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

from tests.worker.batchrun import make_batch, run_all, steps
from tests.worker.test_worker_kv_quant import (PROMPTS, Q4, Q8, SYSTEM, _engine, gen, ids_gen,
                                               run_one, tokens, worker_args)
from worker.kvcache.prefix import PrefixCache
from worker.kvcache.quantized import KVFormat
from worker.loading.startup import make_batch as startup_batch


@pytest.fixture(scope="module")
def sliding(models_dir):
    return _engine(models_dir, "tiny-sliding-kvq")


@pytest.mark.parametrize("fmt", [Q8, Q4], ids=["8bit", "4bit"])
def test_the_global_layers_are_quantized_and_a_batch_equals_each_alone(sliding, fmt):
    engine, _ = sliding
    assert [type(c) for c in fmt.make(engine.model)] == [RotatingKVCache, QuantizedKVCache] * 2
    preps = {n: engine.prepare(gen(n, max_tokens=20)) for n in PROMPTS}
    assert max(len(p.ids) for p in preps.values()) > 16  # (past the window)
    together = run_all(make_batch(engine, kv_format=fmt), preps, join={"c": 3})
    for name in PROMPTS:
        solo = list(steps(engine, engine.prepare(gen(name, max_tokens=20)),
                          make_batch(engine, kv_format=fmt)))
        assert tokens(together[name]) == tokens(solo) and len(tokens(solo)) == 20, name
    # The format is in effect: the global layers' rounding moves the log-probabilities.
    lp = {kv: [o[3].logprob for o in steps(engine, engine.prepare(
        gen("d", max_tokens=4, logprobs=True)), make_batch(engine, kv_format=kv))
        if o is not None]
        for kv in (fmt, KVFormat())}
    assert lp[fmt] != lp[KVFormat()]


def test_prefix_reuse_and_a_snapshot_resume_give_the_cold_text(sliding, tmp_path):
    engine, path = sliding
    # The window wraps in the system prompt: only states kept at a prefix serve.
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), kv_format=Q8)
    run_one(batch, engine, ids_gen(SYSTEM + [1, 2]))
    cached, out = run_one(batch, engine, ids_gen(SYSTEM + [1, 2]))
    assert cached == len(SYSTEM) + 1
    assert out == run_one(make_batch(engine, kv_format=Q8), engine, ids_gen(SYSTEM + [1, 2]))[1]
    # A worker's batch (the load check passes), its named snapshot resumed from disk by
    # a fresh worker of the format.
    args = ("--kv-bits", "8", "--kv-group-size", "32", "--kv-budget", "256M")
    first = startup_batch(engine, worker_args(tmp_path, *args), path)
    assert first.kv_format.bits == 8
    _, said = run_one(first, engine, ids_gen(SYSTEM, "t1", keep_as="turn1"))
    first.close()  # (the write reaches the disk)
    turn2 = SYSTEM + said + [5, 6, 7]
    again = startup_batch(engine, worker_args(tmp_path, *args), path)
    cached, warm = run_one(again, engine, ids_gen(turn2, "t2", resume_from="turn1"))
    assert cached == len(SYSTEM) + len(said)
    assert warm == run_one(make_batch(engine, kv_format=Q8), engine, ids_gen(turn2, "c"))[1]
    again.close()


def test_the_budget_counts_a_window_once_and_the_global_layers_per_token(sliding, tmp_path):
    from worker.loop.sizing import KVSize

    engine, path = sliding
    full, q8 = KVSize.measure(engine.model), KVSize.measure(engine.model, kv_format=Q8)
    assert [size for _, size in full.windows] == [16, 16] and full.per_token > 0
    assert q8.windows == full.windows and q8.per_token == full.per_token * 10 / 32
    # Past the window a token costs the global layers' bytes alone.
    assert full.of(1000) - full.of(999) == pytest.approx(full.per_token, abs=1)
    for kv in (full, q8):
        for budget in (10_000, 1 << 20, 123_457):
            n = kv.tokens_within(budget)
            assert kv.of(n) <= budget < kv.of(n + 1)
    # A worker's context within its budget: what the windows take is counted once.
    budget = full.of(3000)
    batch = startup_batch(engine, worker_args(tmp_path, "--kv-budget", str(budget),
                                              "--prompt-cache-bytes", "0"), path)
    assert batch.engine.context_length == 3000
