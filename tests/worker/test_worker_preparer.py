"""Preparation (template, tokenization, grammar) runs off the MLX thread (issue #9, 3 and 7).

In-process with the real engine and scheduler; the engine's `prepare` is wrapped so a
test can hold one request's preparation open and act meanwhile. Every wait is bounded:
if preparation held the MLX thread, or a Done went missing, a test fails, never hangs.
"""

from __future__ import annotations

import threading

import pytest

from protocol.messages import Cancel, Generate, Shutdown
from tests.generates import generate
from tests.worker.test_worker_scheduler import FakeLink, serve
from worker.loop.scheduler import Scheduler
from worker.status import WorkerStatus
from tests.worker.batchrun import make_batch

WAIT = 10.0  # s: far beyond what any of these steps takes


class HeldPreparation:
    """engine.prepare, except that the request `rid` signals `entered` and then waits
    for `release` before it is prepared."""

    def __init__(self, engine, monkeypatch, rid: str):
        self.rid = rid
        self.entered, self.release, self.left = (threading.Event() for _ in range(3))
        self._released_in_time = None
        self.threads = set()
        real = engine.prepare

        def prepare(gen):
            self.threads.add(threading.current_thread().name)
            if gen.rid == rid:
                self.entered.set()
                self._released_in_time = self.release.wait(WAIT)
                self.left.set()
            return real(gen)

        monkeypatch.setattr(engine, "prepare", prepare)

    @property
    def released_in_time(self) -> bool:
        """Whether the held preparation was released before WAIT ran out. Waits for its
        thread to have left the hold: a cancelled request's preparation may still be
        leaving it when the scheduler has already answered and stopped."""
        return self.left.wait(2 * WAIT) and self._released_in_time


def gen(rid: str, max_tokens: int = 5) -> Generate:
    return generate(rid=rid, prompt="Hello", max_tokens=max_tokens, temperature=0.0)


def test_decoding_goes_on_while_a_request_is_prepared(engine, monkeypatch):
    held = HeldPreparation(engine, monkeypatch, "b")
    after_entered = []

    def on_send(msg, link):
        # b's preparation is released only once a streams on while it is held open:
        # impossible if preparing b held the thread that decodes a.
        if msg.kind == "delta" and msg.rid == "a" and held.entered.is_set():
            after_entered.append(msg)
            if len(after_entered) == 5:
                held.release.set()

    link, _ = serve(engine, [gen("a", max_tokens=400), gen("b")], on_send)
    assert held.released_in_time and len(after_entered) >= 5
    assert link.of("a")[-1].finish_reason == "length"
    assert link.kinds("b")[0] == "started" and link.of("b")[-1].finish_reason == "length"
    assert held.threads <= {"prepare", "prepare-2"}  # never the MLX (here: the test's) thread


def run_with_client(engine, commands, client, stop_after: tuple[str, ...] = ()) -> FakeLink:
    """Run a scheduler over `commands` while `client(link)` acts from another thread; a
    Shutdown follows the last Done of the requests `stop_after`."""
    link, status = FakeLink(), WorkerStatus(epoch=3)
    link.on_send = lambda msg: (msg.kind == "done" and msg.rid in stop_after
                                and all("done" in link.kinds(r) for r in stop_after)
                                and link.commands.put(Shutdown()))
    for c in commands:
        link.commands.put(c)
    t = threading.Thread(target=client, args=(link,))
    t.start()
    Scheduler(engine, link, status, make_batch(engine)).run()
    t.join(WAIT)
    return link


def done_within(link, rid: str, seconds: float) -> bool:
    """Whether `rid`'s Done went out within `seconds` (looked for every 10 ms)."""
    for _ in range(int(seconds / 0.01)):
        if "done" in link.kinds(rid):
            return True
        threading.Event().wait(0.01)
    return "done" in link.kinds(rid)


def test_cancel_during_preparation_is_answered_at_once_and_only_once(engine, monkeypatch):
    held = HeldPreparation(engine, monkeypatch, "slow")
    answered_while_held = []

    def client(link):
        held.entered.wait(WAIT)
        link.commands.put(Cancel(rid="slow"))
        answered_while_held.append(done_within(link, "slow", WAIT / 2))  # within the hold
        held.release.set()

    link = run_with_client(engine, [gen("slow"), gen("after")], client, stop_after=("slow", "after"))
    assert answered_while_held == [True] and held.released_in_time
    assert link.kinds("slow") == ["done"] and link.of("slow")[0].finish_reason == "cancelled"
    # Behind it in the preparation queue, the next request is served normally.
    assert link.kinds("after")[0] == "started"
    assert link.of("after")[-1].finish_reason == "length"


def test_a_long_preparation_does_not_hold_up_the_request_behind_it(engine, monkeypatch):
    """Two preparation threads (scheduler PREPARERS): while one request's preparation
    stays open (a grammar's compile, a huge prompt's tokenizing), the next one is
    prepared, admitted and answered; the first is served once released."""
    held = HeldPreparation(engine, monkeypatch, "slow")
    done_while_held = []

    def client(link):
        held.entered.wait(WAIT)
        link.commands.put(gen("quick"))
        done_while_held.append(done_within(link, "quick", WAIT / 2))  # within the hold
        held.release.set()

    link = run_with_client(engine, [gen("slow")], client, stop_after=("slow",))
    assert done_while_held == [True] and held.released_in_time
    assert link.of("quick")[-1].finish_reason == "length"
    assert link.kinds("slow")[0] == "started" and link.of("slow")[-1].finish_reason == "length"
    assert held.threads == {"prepare", "prepare-2"}


def test_requests_prepared_out_of_order_wait_in_arrival_order(engine):
    """Of the prepared requests, the earliest is admitted first, whichever preparation
    ended first; suspects re-queued at the front stay there."""
    from worker.loop.sequence import Sequence

    scheduler = Scheduler(engine, FakeLink(), WorkerStatus(epoch=3), make_batch(engine))
    seqs = {r: Sequence(gen(r)) for r in "abcd"}
    for i, r in enumerate("abcd"):
        seqs[r].t0 = float(i)
    suspect = Sequence(gen("s"))
    suspect.t0, suspect.suspect = 9.0, True
    scheduler.waiting.append(suspect)
    for r in "dbca":  # the order the preparations ended in
        scheduler._queue(seqs[r])
    assert [s.rid for s in scheduler.waiting] == ["s", "a", "b", "c", "d"]


def test_shutdown_during_preparation_answers_it_once(engine, monkeypatch):
    held = HeldPreparation(engine, monkeypatch, "slow")

    def client(link):
        held.entered.wait(WAIT)
        link.commands.put(Shutdown())

    try:
        link = run_with_client(engine, [gen("slow")], client)
        assert held.entered.is_set() and not held.release.is_set()
        assert link.kinds("slow") == ["done"]
        assert link.of("slow")[0].finish_reason == "cancelled"
    finally:
        held.release.set()


def test_requests_arriving_together_are_prefilled_together(engine, monkeypatch):
    """A burst whose preparations finish one by one joins the batch as one prefill, not
    as the first request alone and the rest behind its prefill (scheduler `_gather`):
    every request is admitted (its Started) before any first token goes out."""
    import time

    import worker.loop.gathering as sched

    monkeypatch.setattr(sched, "GATHER", WAIT)  # the bound is not what is tested here
    real = engine.prepare

    def slow(gen):
        time.sleep(0.1)  # far longer than the tiny model's prefill and first token
        return real(gen)

    monkeypatch.setattr(engine, "prepare", slow)
    rids = ["a", "b", "c", "d"]
    link, _ = serve(engine, [gen(r) for r in rids], max_size=4)
    kinds = [(m.kind, m.rid) for m in link.sent if m.kind in ("started", "delta")]
    first_delta = next(i for i, (kind, _) in enumerate(kinds) if kind == "delta")
    assert sorted(rid for kind, rid in kinds[:first_delta] if kind == "started") == rids
    assert all(link.of(r)[-1].finish_reason == "length" for r in rids)


def test_a_decoding_sequence_never_waits_for_a_request_being_prepared(engine, monkeypatch):
    """Gathering holds a prefill only while nothing decodes: a request that arrives
    while another streams, and whose preparation stays open, never stops that stream
    (here the preparation is released only after five more of its tokens went out)."""
    import worker.loop.gathering as sched

    monkeypatch.setattr(sched, "GATHER", 3 * WAIT)  # were it to wait, it would wait long
    held = HeldPreparation(engine, monkeypatch, "b")
    deltas = []

    def on_send(msg, link):
        if msg.kind != "delta" or msg.rid != "a":
            return
        deltas.append(msg)
        if len(deltas) == 1:
            link.commands.put(gen("b"))
        elif held.entered.is_set() and len(deltas) >= 7:
            held.release.set()

    link, _ = serve(engine, [gen("a", max_tokens=400)], on_send, max_size=2)
    assert held.released_in_time
    assert link.of("a")[-1].finish_reason == "length"
    assert link.of("b")[-1].finish_reason == "length"


def test_a_burst_that_arrives_over_time_is_prefilled_together(engine, monkeypatch):
    """Requests that arrive less than QUIET apart are a burst: with nothing decoding, the
    prefill waits up to QUIET after the last for the next (within GATHER), so the clients'
    one-by-one sends join in one prefill; a request that arrives alone waits for none."""
    import worker.loop.gathering as sched

    monkeypatch.setattr(sched, "GATHER", 3 * WAIT)
    monkeypatch.setattr(sched, "QUIET", WAIT / 5)  # (2 s: were it not waited for, the
    rids = ["a", "b", "c", "d"]                    # tiny model streamed meanwhile)

    def client(link):
        for r in rids[:2]:
            link.commands.put(gen(r))
        threading.Event().wait(WAIT / 20)  # the rest of the burst, half a second later
        for r in rids[2:]:
            link.commands.put(gen(r))

    link = run_with_client(engine, [], client, stop_after=tuple(rids))
    kinds = [(m.kind, m.rid) for m in link.sent if m.kind in ("started", "delta")]
    first_delta = next(i for i, (kind, _) in enumerate(kinds) if kind == "delta")
    assert sorted(rid for kind, rid in kinds[:first_delta] if kind == "started") == rids
    assert all(link.of(r)[-1].finish_reason == "length" for r in rids)

    # Alone, a request waits for no burst: its Done well within QUIET.
    answered = []
    link = run_with_client(engine, [gen("lone")], lambda link: answered.append(
        done_within(link, "lone", WAIT / 10)), stop_after=("lone",))
    assert answered == [True] and link.of("lone")[-1].finish_reason == "length"


def test_a_prefill_waits_for_a_preparation_as_long_as_a_prefill_step_took(engine, monkeypatch):
    """The gathering bound is what the last step that began a prefill took (up to
    GATHER_MAX), not GATHER alone: a request whose preparation outlasts GATHER (an image
    decoded and resized) still joins the burst's prefill when a prefill step costs more
    than the wait; and a step is timed as a prefill only when one begins in it."""
    import time

    import worker.loop.gathering as gathering

    monkeypatch.setattr(gathering, "GATHER", 0.05)
    monkeypatch.setattr(gathering, "GATHER_MAX", 3 * WAIT)
    monkeypatch.setattr(gathering.Gathering, "_prefill_took", WAIT)  # a slow prefill step
    real = engine.prepare

    def prepare(gen):
        if gen.rid == "slow":
            time.sleep(0.5)  # ten times GATHER
        return real(gen)

    monkeypatch.setattr(engine, "prepare", prepare)
    rids = ["quick", "slow"]
    link, _ = serve(engine, [gen(r) for r in rids], max_size=2)
    kinds = [(m.kind, m.rid) for m in link.sent if m.kind in ("started", "delta")]
    first_delta = next(i for i, (kind, _) in enumerate(kinds) if kind == "delta")
    assert sorted(rid for kind, rid in kinds[:first_delta] if kind == "started") == rids

    class Seq:
        def __init__(self, tokens):
            self.completion_tokens = tokens

    timed = gathering.Gathering()
    timed.active = {"a": Seq(3)}
    timed._timed_step(lambda: time.sleep(0.05))  # a decode step: not a prefill's time
    assert timed._prefill_took == WAIT
    timed.active["b"] = Seq(0)
    timed._timed_step(lambda: time.sleep(0.05))
    assert 0.05 <= timed._prefill_took < WAIT
