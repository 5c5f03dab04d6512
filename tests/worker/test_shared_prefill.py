"""One prefill for a prompt's repeats (worker/loop/batch.py `same`, `waits`): requests
that arrive together with the same prompt (a request's `n` choices) are prefilled once.
The first keeps its prompt's state when its prefill ends; the others wait for it and then
start from it in the prefix cache, one token each, with the text each gives alone. Run by
the real scheduler over the real batch on the tiny model (prefill step 64)."""

from __future__ import annotations

import random

import pytest

from protocol.messages import Generate, Shutdown, pack_ids, unpack_ids
from tests.generates import generate
from tests.worker.batchrun import make_batch
from tests.worker.test_worker_scheduler import FakeLink
from worker.kvcache.prefix import PrefixCache
from worker.loop.scheduler import Scheduler
from worker.status import WorkerStatus

PROMPT = [random.Random(3).randrange(10, 200) for _ in range(300)]


def run(engine, commands, prefix: bool = True, after_started=None, on_send=None):
    """The scheduler over `commands` on a batch of 8 (with a prefix cache unless not
    `prefix`), and `after_started`'s commands once the first request has started;
    `on_send(msg, link)` sees each message; a Shutdown once every rid is done. Returns
    (link, batch)."""
    link, status = FakeLink(), WorkerStatus(epoch=1)
    later = list(after_started or ())
    rids = {c.rid for c in commands + later if isinstance(c, Generate)}
    done = set()

    link.at = {}  # (kind, rid): the scheduler's steps when its first such was sent

    def hook(msg):
        link.at.setdefault((msg.kind, getattr(msg, "rid", None)), status.steps)
        if on_send is not None:
            on_send(msg, link)
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


def cached(link, rid) -> int:
    """The prompt tokens the KV cache supplied, as the request's Done reports them (a
    repeat's Started comes before it knows: it is sent as the repeat starts waiting)."""
    (started,) = [m for m in link.of(rid) if m.kind == "started"]
    (done,) = [m for m in link.of(rid) if m.kind == "done"]
    assert started.prompt_tokens == done.prompt_tokens
    return done.cached_tokens


@pytest.mark.parametrize("kind", ["engine", "hybrid_engine"])
def test_the_repeats_of_a_prompt_start_from_its_one_prefill(kind, request):
    # (hybrid: recurrent layers, a cache that cannot be trimmed, which keeps its prompt's
    # state at its end anyway: the repeats wait for that one)
    engine = request.getfixturevalue(kind)
    link, batch = run(engine, [ask("a"), ask("b"), ask("c")])
    alone, _ = run(engine, [ask("alone")], prefix=False)
    assert tokens(alone, "alone") and all(tokens(link, r) == tokens(alone, "alone")
                                          for r in "abc")
    assert cached(link, "a") == 0
    assert cached(link, "b") == cached(link, "c") == 299
    assert batch.kvcache.prefix.stats()["hits"] == 2  # (b and c: a's kept prompt)


def test_a_first_choice_keeps_its_prompt_for_repeats_that_come_after_it(engine):
    # (The supervisor's `n` choices: the first says how many follow, PromptCache.repeats;
    # here the repeat arrives only once the first has started, as a slow preparation
    # would have it, and without the count nothing waits for it.)
    told, _ = run(engine, [ask("a", repeats=1)], after_started=[ask("b")])
    untold, _ = run(engine, [ask("a")], after_started=[ask("b")])
    assert cached(told, "b") == 299 and cached(untold, "b") == 0
    assert tokens(told, "b") == tokens(told, "a") == tokens(untold, "b")


def test_a_request_behind_a_waiting_repeat_goes_ahead_of_it(engine):
    other = [random.Random(4).randrange(10, 200) for _ in range(20)]
    link, _ = run(engine, [ask("a"), ask("b"), ask("d", prompt=other)])
    # d joined with a, before any step; b (Started at once: its prompt is being
    # prefilled) produced its first token only after a's prefill of 5 chunks of 64.
    assert link.at["started", "d"] == link.at["started", "b"] == 0
    assert link.at["delta", "d"] < 5 <= link.at["delta", "b"]
    assert cached(link, "b") == 299 and cached(link, "d") == 0
    assert tokens(link, "a") == tokens(link, "b") and len(tokens(link, "d")) == 8


def test_a_repeat_cancelled_while_it_waits_ends_once(engine):
    from protocol.messages import Cancel

    def cancel_b(msg, link):
        if msg.kind == "started" and msg.rid == "b":
            link.commands.put(Cancel(rid="b"))

    link, batch = run(engine, [ask("a"), ask("b"), ask("c")], on_send=cancel_b)
    assert link.kinds("b") == ["started", "done"]
    assert link.of("b")[-1].finish_reason == "cancelled"
    assert cached(link, "c") == 299 and tokens(link, "c") == tokens(link, "a")
    assert not batch.members and len(tokens(link, "a")) == 8


def test_prompts_that_differ_or_a_batch_without_a_prefix_cache_prefill_each(engine):
    other = PROMPT[:-1] + [PROMPT[-1] + 1]
    link, batch = run(engine, [ask("a"), ask("b", prompt=other),
                               ask("c", namespace="elsewhere")])
    assert [cached(link, r) for r in "abc"] == [0, 0, 0]
    # (none waited: b and c started before a's first token)
    order = [(m.kind, m.rid) for m in link.sent]
    assert order.index(("started", "c")) < order.index(("delta", "a"))
    plain, _ = run(engine, [ask("a"), ask("b")], prefix=False)
    assert [cached(plain, r) for r in "ab"] == [0, 0]
    assert tokens(plain, "a") == tokens(plain, "b") == tokens(link, "a")


def test_a_trimmable_cache_keeps_a_shared_prompt_but_its_last_token():
    from worker.kvcache.manager import KVCache

    kv = KVCache(PrefixCache(1 << 20), trimmable=True)
    assert kv.checkpoints(0, 300) == [] and kv.checkpoints(0, 300, shared=True) == [299]
    assert kv.checkpoints(299, 300, shared=True) == []  # (it starts there already)
