"""A request's Done leaves before its final KV state is stored (worker/loop/batch.py
`settle`: materializing and storing the state took about a decode step, and the last
tokens waited for it, issue 36), and the state is still there for the next prompt."""

from __future__ import annotations

import pytest

from protocol.messages import Generate, Shutdown
from tests.generates import generate
from tests.worker.batchrun import make_batch, steps
from tests.worker.test_worker_scheduler import FakeLink
from worker.kvcache.prefix import PrefixCache
from worker.loop.scheduler import Scheduler
from worker.status import WorkerStatus

PROMPT = "Once upon a time there was a little model that could"


@pytest.mark.parametrize("stop", [[], ["e"]])  # ended by mlx-lm (length), by a stop string
def test_the_done_leaves_before_the_state_is_stored_and_the_next_prompt_finds_it(engine, stop):
    order = []
    batch = make_batch(engine, prefix=PrefixCache(1 << 30))
    finish = batch.kvcache.finish
    batch.kvcache.finish = lambda *a, **kw: (order.append("stored"), finish(*a, **kw))[1]
    link = FakeLink()
    gens = [generate(rid=r, prompt=PROMPT, max_tokens=40, temperature=0.0, stop=stop)
            for r in ("a", "b")]

    def on_send(msg):
        if msg.kind == "done":
            order.append(f"done {msg.rid}")
            if msg.rid == "a":
                link.commands.put(gens[1])  # the same prompt, after a's end
            else:
                link.commands.put(Shutdown())

    link.on_send = on_send
    link.commands.put(gens[0])
    Scheduler(engine, link, WorkerStatus(epoch=1), batch).run()
    assert order[:2] == ["done a", "stored"]
    (started_b,) = [m for m in link.of("b") if m.kind == "started"]
    assert started_b.cached_tokens > 0  # a's stored state served b's prompt
    assert link.of("a")[-1].finish_reason == ("stop" if stop else "length")


def test_a_batch_stepped_without_a_scheduler_stores_at_once(engine):
    batch = make_batch(engine, prefix=PrefixCache(1 << 30))
    prep = engine.prepare(generate(rid="x", prompt=PROMPT, max_tokens=4, temperature=0.0))
    assert len([o for o in steps(engine, prep, batch) if o is not None]) == 4
    assert batch.kvcache.stats().entries == 1 and not batch._ended
