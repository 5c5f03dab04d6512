"""The prompt-prefix cache (worker/kvcache/prefix.py) with the real batch and the tiny model:
reuse gives the cold run's output, across turns and namespaces, within bytes and time."""

from __future__ import annotations

from protocol.messages import pack_ids
from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch, run_all
from worker.kvcache.prefix import PrefixCache

SYSTEM = [10 + (i * 7) % 900 for i in range(300)]  # a 300-token "system prompt"


def ids_gen(ids, name="r", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0.0)
    return generate(rid=name, prompt_ids=pack_ids(ids), **kw)


def run_one(batch, engine, g):
    """(prompt tokens the cache supplied, generated tokens)."""
    seq = Seq(g.rid)
    cached = batch.add(seq, engine.prepare(g))
    out = []
    while batch.members:
        out += [o for _, o in batch.step()]
    return cached, [o[0] for o in out if o[0] >= 0]


def test_a_repeated_prompt_reuses_its_prefix_and_gives_the_cold_output(engine):
    cache = PrefixCache(1 << 30)
    batch = make_batch(engine, prefix=cache)
    cold_cached, cold = run_one(batch, engine, ids_gen(SYSTEM + [5, 6, 7]))
    assert cold_cached == 0 and len(cache) == 1
    warm_cached, warm = run_one(batch, engine, ids_gen(SYSTEM + [5, 6, 7]))
    assert warm_cached == len(SYSTEM) + 2  # all but the last token, which starts decoding
    assert warm == cold
    # A different tail shares the system prompt: trimmed back to the common prefix.
    other_cached, other = run_one(batch, engine, ids_gen(SYSTEM + [8, 9]))
    assert other_cached == len(SYSTEM)
    assert other == run_one(make_batch(engine), engine, ids_gen(SYSTEM + [8, 9]))[1]
    assert cache.hits == 2 and cache.misses == 1
    assert cache.tokens_reused == warm_cached + other_cached


def test_the_next_turn_of_a_conversation_reuses_the_previous_one(engine):
    """An agent's next prompt is the previous prompt, the reply and a new message."""
    batch = make_batch(engine, prefix=PrefixCache(1 << 30))
    turn1 = SYSTEM + [20, 21, 22]
    _, reply = run_one(batch, engine, ids_gen(turn1))
    turn2 = turn1 + reply + [30, 31, 32, 33]
    cached, out = run_one(batch, engine, ids_gen(turn2))
    assert cached >= len(turn1) + len(reply) - 1
    assert out == run_one(make_batch(engine), engine, ids_gen(turn2))[1]


def test_prompt_cache_keys_are_namespaces(engine):
    batch = make_batch(engine, prefix=PrefixCache(1 << 30))
    run_one(batch, engine, ids_gen(SYSTEM + [1, 2], namespace="alice"))
    assert run_one(batch, engine, ids_gen(SYSTEM + [1, 2], namespace="bob"))[0] == 0
    assert run_one(batch, engine, ids_gen(SYSTEM + [1, 2]))[0] == 0  # the shared one
    assert run_one(batch, engine, ids_gen(SYSTEM + [1, 2], namespace="alice"))[0] > 0


def test_batched_requests_store_and_reuse(engine):
    cache = PrefixCache(1 << 30)
    batch = make_batch(engine, prefix=cache)
    preps = {n: engine.prepare(ids_gen(SYSTEM + [n], name=str(n))) for n in (1, 2, 3)}
    cold = run_all(batch, preps)
    assert len(cache) >= 1
    again = {n: engine.prepare(ids_gen(SYSTEM + [n], name=str(n))) for n in (1, 2, 3)}
    seqs = {n: Seq(str(n)) for n in again}
    assert all(batch.add(seqs[n], again[n]) >= len(SYSTEM) for n in again)
    warm = {str(n): [] for n in again}
    while batch.members:
        for seq, o in batch.step():
            warm[seq.rid].append(o)
    for n in preps:
        assert [o[0] for o in warm[str(n)]] == [o[0] for o in cold[n]]


def test_eviction_under_a_small_byte_budget(engine):
    probe = PrefixCache(1 << 30)
    run_one(make_batch(engine, prefix=probe), engine, ids_gen(SYSTEM + [1]))
    one = probe.nbytes
    cache = PrefixCache(one + one // 2)  # room for one entry of this size, not two
    batch = make_batch(engine, prefix=cache)
    run_one(batch, engine, ids_gen(SYSTEM + [1]))
    run_one(batch, engine, ids_gen([1000 - t for t in SYSTEM] + [1]))  # shares nothing
    assert len(cache) == 1 and cache.evictions == 1 and cache.nbytes <= cache.max_bytes
    # The survivor is the newer one.
    assert run_one(batch, engine, ids_gen([1000 - t for t in SYSTEM] + [1]))[0] > 0


def test_entries_expire_after_the_ttl(engine):
    now = [1000.0]
    cache = PrefixCache(1 << 30, ttl=60, clock=lambda: now[0])
    batch = make_batch(engine, prefix=cache)
    run_one(batch, engine, ids_gen(SYSTEM + [1]))
    now[0] += 59
    assert run_one(batch, engine, ids_gen(SYSTEM + [1]))[0] > 0  # used: its clock restarts
    now[0] += 61
    assert run_one(batch, engine, ids_gen(SYSTEM + [1]))[0] == 0
    assert cache.expirations == 1


def test_a_state_that_disagrees_with_its_tokens_is_never_used(engine):
    cache = PrefixCache(1 << 30)
    batch = make_batch(engine, prefix=cache)
    run_one(batch, engine, ids_gen(SYSTEM + [1]))
    (ns, key), entry = next(iter(cache._lru.items()))
    # Storing a state under more tokens than it holds is refused ...
    assert not cache.store("", list(key) + [5], entry.cache)
    # ... and an entry whose state went wrong is dropped at lookup, as a miss.
    for layer in entry.cache:
        layer.offset -= 3
    assert cache.fetch("", list(key) + [1]) is None
    assert len(cache) == 0 and cache.misses >= 1


def test_a_rotating_cache_is_reused_from_its_prompt_snapshot(engine):
    """--max-kv-size: once the window wraps the state cannot be trimmed, so only the
    snapshot taken at the end of the prompt serves the next request with that prompt."""
    cache = PrefixCache(1 << 30)
    batch = make_batch(engine, prefix=cache, max_kv_size=64)
    prompt = SYSTEM[:150] + [3]
    cold_cached, cold = run_one(batch, engine, ids_gen(prompt, max_tokens=30))
    warm_cached, warm = run_one(batch, engine, ids_gen(prompt, max_tokens=30))
    assert (cold_cached, warm_cached) == (0, 150)
    assert warm == cold
    assert cold == run_one(make_batch(engine, max_kv_size=64), engine,
                           ids_gen(prompt, max_tokens=30))[1]


def test_long_prompts_leave_snapshots_along_the_way(engine):
    """An untrimmable state is snapshotted every `snapshot_every` prompt tokens, so a
    prompt sharing only the first part of a long one still starts from the last
    snapshot inside the shared part."""
    cache = PrefixCache(1 << 30)
    batch = make_batch(engine, prefix=cache, max_kv_size=64, snapshot_every=100)
    long = [10 + (i * 13) % 900 for i in range(350)]
    run_one(batch, engine, ids_gen(long, max_tokens=4))
    assert len(cache) == 5  # at 100, 200, 300, 349 (the prompt but its last token), the end
    branch = long[:250] + [7, 8, 9]
    cached, out = run_one(batch, engine, ids_gen(branch, max_tokens=8))
    assert cached == 200
    assert out == run_one(make_batch(engine, max_kv_size=64), engine,
                          ids_gen(branch, max_tokens=8))[1]
