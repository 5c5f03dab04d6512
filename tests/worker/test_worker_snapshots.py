"""Named KV snapshots (worker/kvcache/) with the real batch and tiny models: a chain of
turns prefills only what is new, from memory and from disk (a fresh worker), with the cold
run's output; a rewritten history falls back, counted; the hybrid model resumes from its
recurrent state."""

from __future__ import annotations

import pytest

from protocol.messages import pack_ids
from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch
from worker.kvcache.disk import DiskTier
from worker.kvcache.prefix import PrefixCache
from worker.loop.preparer import prepare

SYSTEM = [10 + (i * 7) % 900 for i in range(200)]


def ids_gen(ids, name="r", **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return generate(rid=name, prompt_ids=pack_ids(ids), **kw)


def run_one(batch, engine, g):
    """(prompt tokens not prefilled, generated tokens), the preparation thread's part
    (the disk read) included."""
    prep = prepare(engine, batch.kvcache, g)
    cached = batch.add(Seq(g.rid), prep)
    out = []
    while batch.members:
        out += [o for _, o in batch.step()]
    return cached, [o[0] for o in out if o[0] >= 0]


def worker(engine, disk_dir=None, prefix_bytes=1 << 30):
    """What one worker process holds: a batch, its prefix cache, its snapshots."""
    prefix = PrefixCache(prefix_bytes)
    disk = None
    if disk_dir is not None:
        disk = DiskTier(disk_dir, 1 << 30)
        disk.start()
    batch = make_batch(engine, prefix=prefix, disk=disk)
    return batch, batch.kvcache.snapshots


def chain(batch, engine, turns=3, resume_first=None):
    """Turns of one conversation, each resuming from the one before: [(prompt, cached,
    reply)]."""
    prompt, out, previous = SYSTEM + [1, 2, 3], [], resume_first
    for n in range(turns):
        cached, reply = run_one(batch, engine, ids_gen(prompt, f"t{n}", keep_as=f"resp_{n}",
                                                       resume_from=previous))
        out.append((prompt, cached, reply))
        previous = f"resp_{n}"
        prompt = prompt + reply + [40 + n, 41 + n, 42 + n]
    return out


@pytest.mark.parametrize("model", ["tiny", "hybrid"])
def test_each_turn_prefills_only_its_new_tokens_with_the_cold_output(engine, hybrid_engine,
                                                                      model):
    engine = engine if model == "tiny" else hybrid_engine
    batch, store = worker(engine)
    turns = chain(batch, engine)
    assert turns[0][1] == 0
    for n in (1, 2):
        prompt, cached, reply = turns[n]
        prev_prompt, _, prev_reply = turns[n - 1]
        # Everything the previous turn held (its prompt and reply) came from its snapshot.
        assert cached == len(prev_prompt) + len(prev_reply)
        assert len(prompt) - cached == 3
        cold = run_one(make_batch(engine), engine, ids_gen(prompt))[1]
        assert reply == cold
    assert store.hits_ram == 2 and store.misses == 0 and store.fallbacks == 0


def test_a_fresh_worker_resumes_from_the_disk_tier(engine, tmp_path):
    batch, store = worker(engine, tmp_path / "kv")
    first = chain(batch, engine, turns=2)
    assert store.disk.flush()
    assert {e.name for e in store.entries()} == {"resp_0", "resp_1"}
    # A new process: empty memory, the same directory.
    batch2, store2 = worker(engine, tmp_path / "kv")
    assert store2.disk.stats()["disk_entries"] == 2
    prompt, _, reply = first[1]
    nxt = prompt + reply + [77, 78]
    cached, out = run_one(batch2, engine, ids_gen(nxt, resume_from="resp_1", keep_as="resp_2"))
    assert cached == len(prompt) + len(reply)
    assert store2.hits_disk == 1 and store2.hits_ram == 0
    assert out == run_one(make_batch(engine), engine, ids_gen(nxt))[1]
    # Read once: memory has it now.
    again, _ = run_one(batch2, engine, ids_gen(nxt, resume_from="resp_1"))
    assert again == cached and store2.hits_ram == 1 and store2.hits_disk == 1


def test_a_rewritten_history_falls_back_counted_with_the_right_output(engine, tmp_path):
    batch, store = worker(engine, tmp_path / "kv")
    (prompt, _, reply), = chain(batch, engine, turns=1)
    # The template rewrote the previous reply (thinking stripped, say): not a prefix.
    rewritten = prompt + [5] + reply[1:] + [60, 61]
    cached, out = run_one(batch, engine, ids_gen(rewritten, resume_from="resp_0"))
    assert store.fallbacks == 1 and store.hits_ram == 0
    assert cached == len(prompt)  # prefix matching still shares the prompt
    assert out == run_one(make_batch(engine), engine, ids_gen(rewritten))[1]
    # From disk in a fresh worker: the shared part of the trimmable state serves.
    store.disk.flush()
    batch2, store2 = worker(engine, tmp_path / "kv")
    cached2, out2 = run_one(batch2, engine, ids_gen(rewritten, resume_from="resp_0"))
    assert store2.fallbacks == 1 and cached2 == len(prompt) and out2 == out


def test_an_unknown_name_is_a_miss_and_the_prompt_runs_cold(engine, tmp_path):
    batch, store = worker(engine, tmp_path / "kv")
    cached, _ = run_one(batch, engine, ids_gen(SYSTEM, resume_from="resp_none"))
    assert cached == 0 and store.misses == 1


def test_snapshots_are_named_only_when_asked(engine, tmp_path):
    batch, store = worker(engine, tmp_path / "kv")
    run_one(batch, engine, ids_gen(SYSTEM + [1]))
    store.disk.flush()
    assert store.entries() == [] and store.disk.stats()["disk_entries"] == 0


def test_admin_save_drop_and_clear(engine, tmp_path):
    batch, store = worker(engine)  # no disk tier
    chain(batch, engine, turns=1)
    assert store.save("resp_0")[0] is False  # nowhere to write
    batch, store = worker(engine, tmp_path / "kv")
    chain(batch, engine, turns=2)
    store.disk.flush()
    store.disk.drop("resp_0")
    ok, message = store.save("resp_0")  # from memory back to disk
    assert ok, message
    store.disk.flush()
    assert store.disk.has("resp_0")
    assert store.save("resp_nope")[0] is False
    assert store.drop("resp_0") and not store.disk.has("resp_0")
    assert [e.name for e in store.entries()] == ["resp_1"]
    assert store.clear() == 1 and store.entries() == [] and len(store.prefix) == 0
