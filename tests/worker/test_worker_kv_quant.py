"""The quantized KV cache (worker/kvcache/quantized.py, --kv-bits) with the real batch on
tiny float32 models whose heads (32) MLX can quantize: batched equals alone, prefix reuse
and snapshot resumes give the cold run's text in the same format, a snapshot is resumed
only by a worker of its format, the budget counts the quantized bytes, a hybrid model
keeps its recurrent state at full precision, and what cannot work is a load error."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache

from protocol.messages import pack_ids
from protocol.settings import worker_parser
from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch, run_all, steps
from worker.errors import LoadError
from worker.kvcache.prefix import PrefixCache
from worker.kvcache.quantized import KVFormat
from worker.loading.startup import make_batch as startup_batch
from worker.loop.sizing import KVSize, StepMemory
from worker.loop.preparer import prepare

PROMPTS = {
    "a": "Once upon a time there was a little model",
    "b": "Hi",
    "c": "The quick brown fox jumps over the lazy dog, and then it runs away",
    "d": "word " * 40,
}
SYSTEM = [10 + (i * 7) % 900 for i in range(200)]
Q8, Q4 = KVFormat.of(8, 32), KVFormat.of(4, 32)   # (4 bits rotated, as --kv-bits 4)


def _engine(models_dir, preset):
    from worker.demos.text import build_model
    from worker.loading import models
    from worker.text.engine import TextEngine

    path = build_model(models_dir / preset, preset).path
    loaded = models.load(str(path), path.parent)
    return TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 64,
                      loaded.vocab_size), path


@pytest.fixture(scope="module", autouse=True)
def step_memory_once():
    """`startup_batch` measures StepMemory (seven prefills and decode steps) at each call,
    and these tests build eight batches of three KV formats on one model: each (model,
    format, rows) is measured once here and its reading reused. What these tests prove
    is the KV format; the measurement is test_worker_batching's and test_memory_bound's."""
    measure, measured = StepMemory.measure, {}

    def once(model, vocab, **kw):
        key = (id(model), vocab, tuple(sorted(kw.items())))
        if key not in measured:
            measured[key] = measure(model, vocab, **kw)
        return measured[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepMemory, "measure", staticmethod(once))
        yield


@pytest.fixture(scope="session")
def kvq(models_dir):
    """(engine, path) of `tiny` with heads of 32 (MLX quantizes groups of 32 and more)."""
    return _engine(models_dir, "tiny-kvq")


@pytest.fixture(scope="session")
def hybrid_kvq(models_dir):
    return _engine(models_dir, "tiny-hybrid-kvq")


def gen(name, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0.0)
    return generate(rid=name, prompt=PROMPTS[name], **kw)


def ids_gen(ids, name="r", **kw):
    kw.setdefault("max_tokens", 10)
    kw.setdefault("temperature", 0.0)
    return generate(rid=name, prompt_ids=pack_ids(ids), **kw)


def tokens(outcomes) -> list[int]:
    return [o[0] for o in outcomes if o is not None and o[0] >= 0]


def run_one(batch, engine, g):
    """(prompt tokens the KV cache supplied, generated tokens), the preparation thread's
    part (a disk read) included."""
    cached = batch.add(Seq(g.rid), prepare(engine, batch.kvcache, g))
    out = []
    while batch.members:
        out += [o for _, o in batch.step()]
    return cached, tokens(out)


def worker_args(tmp_path, *flags):
    return worker_parser().parse_args(["--model", "m", "--commands", "c", "--events", "e",
                                       "--epoch", "0", "--state-dir", str(tmp_path), *flags])


@pytest.mark.parametrize("fmt", [Q8, Q4], ids=["8bit", "4bit"])
def test_greedy_in_a_batch_equals_each_request_alone(kvq, fmt):
    engine, _ = kvq
    batch = make_batch(engine, kv_format=fmt)
    preps = {n: engine.prepare(gen(n)) for n in PROMPTS}
    # "c" joins a batch already decoding (extend), "b" leaves early (filter).
    preps["b"] = engine.prepare(gen("b", max_tokens=6))
    seen = []
    batch.step = _watching(batch, seen)
    together = run_all(batch, preps, join={"c": 5})
    assert any("BatchQuantizedKV" in kinds for kinds in seen)  # (really quantized)
    for name in PROMPTS:
        g = gen(name, max_tokens=6 if name == "b" else 24)
        solo = [o for o in steps(engine, engine.prepare(g), make_batch(engine, kv_format=fmt))
                if o is not None]
        assert tokens(together[name]) == tokens(solo), name


def _watching(batch, seen):
    step = batch.step

    def watched():
        out = step()
        gb = batch.gen._generation_batch
        seen.append({type(c).__name__ for c in gb.prompt_cache})
        return out
    return watched


def test_4_bits_change_the_output_of_full_precision(kvq):
    """The format is in effect: 4-bit keys and values move a greedy choice on this model
    (8 bits do not, here), so a run that ignored --kv-bits would fail here."""
    engine, _ = kvq
    full = {n: tokens(steps(engine, engine.prepare(gen(n)))) for n in PROMPTS}
    q4 = {n: tokens(steps(engine, engine.prepare(gen(n)), make_batch(engine, kv_format=Q4)))
          for n in PROMPTS}
    assert full != q4


@pytest.mark.parametrize("fmt", [Q8, Q4], ids=["8bit", "4bit"])
def test_prefix_reuse_and_snapshot_resume_give_the_cold_text(kvq, fmt):
    engine, _ = kvq
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), kv_format=fmt)
    turn1 = SYSTEM + [1, 2, 3]
    _, reply = run_one(batch, engine, ids_gen(turn1, "t1", keep_as="resp_1"))
    # The same system prompt, another tail: a quantized state trimmed back and reused.
    other = SYSTEM + [8, 9]
    cached, out = run_one(batch, engine, ids_gen(other))
    assert cached == len(SYSTEM)
    assert isinstance(batch.kvcache.prefix.fetch("", other).cache[0], QuantizedKVCache)
    assert out == run_one(make_batch(engine, kv_format=fmt), engine, ids_gen(other))[1]
    # The next turn resumes from the named snapshot.
    turn2 = turn1 + reply + [40, 41]
    cached, out = run_one(batch, engine, ids_gen(turn2, resume_from="resp_1"))
    assert cached == len(turn1) + len(reply)
    assert out == run_one(make_batch(engine, kv_format=fmt), engine, ids_gen(turn2))[1]


def test_a_snapshot_is_resumed_only_by_a_worker_of_its_kv_format(kvq, tmp_path):
    """Written at 8 bits, stored quantized on disk: a fresh 8-bit worker resumes it with
    the cold text; a 4-bit and a full-precision worker on the same state dir do not."""
    engine, path = kvq
    flags = ("--kv-group-size", "32", "--kv-budget", "256M")
    q8 = startup_batch(engine, worker_args(tmp_path, "--kv-bits", "8", *flags), path)
    turn1 = SYSTEM + [1, 2, 3]
    _, reply = run_one(q8, engine, ids_gen(turn1, "t1", keep_as="resp_1"))
    q8.close()  # (the write reaches the disk)
    fmt = q8.kvcache.snapshots.disk.entries()["resp_1"]
    from worker.kvcache import files
    assert "QuantizedKVCache" in files.read(fmt.path).metadata.values()
    turn2 = turn1 + reply + [40, 41]
    cold = run_one(make_batch(engine, kv_format=Q8), engine, ids_gen(turn2))[1]

    again = startup_batch(engine, worker_args(tmp_path, "--kv-bits", "8", *flags), path)
    assert run_one(again, engine, ids_gen(turn2, resume_from="resp_1")) == (
        len(turn1) + len(reply), cold)
    for other in (("--kv-bits", "4", *flags), flags):
        batch = startup_batch(engine, worker_args(tmp_path, *other), path)
        assert batch.kvcache.entries() == []
        cached, _ = run_one(batch, engine, ids_gen(turn2, resume_from="resp_1"))
        assert cached == 0 and batch.kvcache.snapshots.misses == 1
        batch.close()


def test_the_budget_counts_the_quantized_bytes(kvq, tmp_path, monkeypatch):
    """Per token, 8 bits hold (8 + 2 x 32 / 32) / 32 of float32's bytes and 4 bits
    (4 + 2) / 32; the same --kv-budget caps the context that much later and admits that
    many more sequences."""
    engine, path = kvq
    monkeypatch.setattr(engine, "cap_context", lambda tokens: None)  # (a shared engine)
    full = KVSize.measure(engine.model)
    assert KVSize.measure(engine.model, kv_format=Q8).per_token == full.per_token * 10 / 32
    assert KVSize.measure(engine.model, kv_format=Q4).per_token == full.per_token * 6 / 32
    budget = 2 << 20
    fits = {}
    for name, flags in (("full", ()), ("q8", ("--kv-bits", "8")), ("q4", ("--kv-bits", "4"))):
        batch = startup_batch(engine, worker_args(tmp_path / name, "--kv-budget", str(budget),
                                                  "--kv-group-size", "32",
                                                  "--prompt-cache-bytes", "0", *flags), path)
        fits[name] = batch.kv.tokens_within(budget)
        prep = engine.prepare(ids_gen(SYSTEM * 4, max_tokens=200))
        n = 0
        while batch.fits(prep) and n < 8:
            batch.add(Seq(f"s{n}"), prep)
            n += 1
        fits[name + " seqs"] = n
    assert fits["q8"] >= 3 * fits["full"] and fits["q4"] >= 5 * fits["full"]
    assert fits["q4 seqs"] > fits["q8 seqs"] > fits["full seqs"] >= 1


def test_a_hybrid_model_quantizes_attention_and_keeps_its_recurrent_state(hybrid_kvq):
    engine, _ = hybrid_kvq
    cache = Q8.make(engine.model)
    assert {type(c) for c in cache} == {QuantizedKVCache, ArraysCache}
    preps = {n: engine.prepare(gen(n, max_tokens=12)) for n in PROMPTS}
    together = run_all(make_batch(engine, kv_format=Q8), preps)
    for name in PROMPTS:
        solo = steps(engine, engine.prepare(gen(name, max_tokens=12)),
                     make_batch(engine, kv_format=Q8))
        assert tokens(together[name]) == tokens(solo), name
    # Reuse comes from a state kept at a prefix (the recurrent state cannot be trimmed).
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), kv_format=Q8)
    run_one(batch, engine, ids_gen(SYSTEM + [1, 2]))
    cached, out = run_one(batch, engine, ids_gen(SYSTEM + [1, 2]))
    assert cached == len(SYSTEM) + 1
    assert out == run_one(make_batch(engine, kv_format=Q8), engine,
                          ids_gen(SYSTEM + [1, 2]))[1]


@pytest.mark.parametrize("flags, words", [
    (("--kv-bits", "8"), "head dimension (16)"),               # tiny: heads of 16
    (("--kv-bits", "3", "--kv-group-size", "32"), "--kv-bits 3"),
    (("--kv-bits", "8", "--kv-group-size", "48"), "--kv-group-size 48"),
])
def test_what_cannot_work_is_a_load_error(engine, tiny_model, tmp_path, flags, words):
    with pytest.raises(LoadError, match=words.replace("(", r"\(").replace(")", r"\)")):
        startup_batch(engine, worker_args(tmp_path, *flags), tiny_model)


def test_a_model_whose_every_layer_is_a_window_has_nothing_to_quantize(kvq, tmp_path):
    # (--max-kv-size: every layer a rotating cache, which stays at full precision.)
    engine, path = kvq
    with pytest.raises(LoadError, match="no attention KV cache to quantize"):
        startup_batch(engine, worker_args(tmp_path, "--kv-bits", "8", "--kv-group-size",
                                          "32", "--max-kv-size", "64"), path)


def test_kv_bits_0_is_full_precision(kvq, tmp_path):
    """0 lets one model opt out of a server-wide --kv-bits (--model-setting M:kv_bits=0).
    (A vision checkpoint's batch takes --kv-bits: tests/worker/test_worker_vision_kv_quant.py.)"""
    engine, path = kvq
    batch = startup_batch(engine, worker_args(tmp_path, "--kv-bits", "0",
                                              "--prompt-cache-bytes", "0"), path)
    assert not batch.kv_format.quantized
