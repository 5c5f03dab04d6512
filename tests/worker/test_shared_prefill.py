"""One prefill for a prompt's repeats (worker/loop/batch.py `same`, `waits`): requests
that arrive together with the same prompt (a request's `n` choices) are prefilled once.
The first keeps its prompt's state when its prefill ends; the others wait for it and then
start from it in the prefix cache, one token each, with the text each gives alone. Run by
the real scheduler over the real batch on the tiny model (prefill step 64)."""

from __future__ import annotations

import random

from protocol.messages import Generate, Shutdown, pack_ids, unpack_ids
from tests.generates import generate
from tests.worker.batchrun import make_batch
from tests.worker.test_worker_scheduler import FakeLink
from worker.kvcache.prefix import PrefixCache
from worker.loop.scheduler import Scheduler
from worker.status import WorkerStatus

PROMPT = [random.Random(3).randrange(10, 200) for _ in range(300)]


def run(engine, commands, prefix: bool = True, after_started=None):
    """The scheduler over `commands` on a batch of 8 (with a prefix cache unless not
    `prefix`), and `after_started`'s commands once the first request has started; a
    Shutdown once every rid is done. Returns (link, batch)."""
    link, status = FakeLink(), WorkerStatus(epoch=1)
    later = list(after_started or ())
    rids = {c.rid for c in commands + later if isinstance(c, Generate)}
    done = set()

    def hook(msg):
        if msg.kind == "started" and later:
            for c in later:
                link.commands.put(c)
            later.clear()
        if msg.kind == "done":
            done.add(msg.rid)
            if done >= rids:
                link.commands.put(Shutdown())

    link.on_send = hook
    for c in commands:
        link.commands.put(c)
    batch = make_batch(engine, prefix=PrefixCache(1 << 30) if prefix else None)
    Scheduler(engine, link, status, batch).run()
    return link, batch


def ask(rid, prompt=PROMPT, **kw):
    return generate(rid=rid, prompt_ids=pack_ids(prompt), max_tokens=8, temperature=0.0, **kw)


def tokens(link, rid) -> list[int]:
    return [t for m in link.of(rid) if m.kind == "delta" for t in unpack_ids(m.token_ids)]


def started(link, rid):
    (s,) = [m for m in link.of(rid) if m.kind == "started"]
    return s


def test_the_repeats_of_a_prompt_start_from_its_one_prefill(engine):
    link, batch = run(engine, [ask("a"), ask("b"), ask("c")])
    alone, _ = run(engine, [ask("alone")], prefix=False)
    assert tokens(alone, "alone") and all(tokens(link, r) == tokens(alone, "alone")
                                          for r in "abc")
    assert started(link, "a").cached_tokens == 0
    assert started(link, "b").cached_tokens == started(link, "c").cached_tokens == 299
    assert batch.kvcache.prefix.stats()["hits"] == 2  # (b and c: a's kept prompt)


def test_a_first_choice_keeps_its_prompt_for_repeats_that_come_after_it(engine):
    # (The supervisor's `n` choices: the first says how many follow, PromptCache.repeats;
    # here the repeat arrives only once the first has started, as a slow preparation
    # would have it, and without the count nothing waits for it.)
    told, _ = run(engine, [ask("a", repeats=1)], after_started=[ask("b")])
    untold, _ = run(engine, [ask("a")], after_started=[ask("b")])
    assert started(told, "b").cached_tokens == 299 and started(untold, "b").cached_tokens == 0
    assert tokens(told, "b") == tokens(told, "a") == tokens(untold, "b")


def test_a_request_behind_a_waiting_repeat_goes_ahead_of_it(engine):
    other = [random.Random(4).randrange(10, 200) for _ in range(20)]
    link, _ = run(engine, [ask("a"), ask("b"), ask("d", prompt=other)])
    order = [(m.kind, m.rid) for m in link.sent]
    assert order.index(("started", "d")) < order.index(("started", "b"))
    assert started(link, "b").cached_tokens == 299 and started(link, "d").cached_tokens == 0
    assert tokens(link, "a") == tokens(link, "b") and len(tokens(link, "d")) == 8


def test_prompts_that_differ_or_a_batch_without_a_prefix_cache_prefill_each(engine):
    other = PROMPT[:-1] + [PROMPT[-1] + 1]
    link, batch = run(engine, [ask("a"), ask("b", prompt=other),
                               ask("c", namespace="elsewhere")])
    assert [started(link, r).cached_tokens for r in "abc"] == [0, 0, 0]
    # (none waited: b and c started before a's first token)
    order = [(m.kind, m.rid) for m in link.sent]
    assert order.index(("started", "c")) < order.index(("delta", "a"))
    plain, _ = run(engine, [ask("a"), ask("b")], prefix=False)
    assert [started(plain, r).cached_tokens for r in "ab"] == [0, 0]
    assert tokens(plain, "a") == tokens(plain, "b") == tokens(link, "a")


def test_a_trimmable_cache_keeps_a_shared_prompt_but_its_last_token():
    from worker.kvcache.manager import KVCache

    kv = KVCache(PrefixCache(1 << 20), trimmable=True)
    assert kv.checkpoints(0, 300) == [] and kv.checkpoints(0, 300, shared=True) == [299]
    assert kv.checkpoints(299, 300, shared=True) == []  # (it starts there already)
